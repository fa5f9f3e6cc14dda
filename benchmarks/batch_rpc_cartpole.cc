#include "benchmarks/batch_rpc_cartpole.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/log.h>
#include <ATen/ops/multinomial.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cmath>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "benchmarks/common.h"
#include "rpc/rref/rref.h"
#include "models/cartpole.h"

namespace ddprpc::benchmarks::batch_rpc {
namespace {

namespace bench = ::ddprpc::benchmarks;

using ::ddprpc::models::CartPole;

// 4 -> 128 -> dropout(0.6) -> relu -> 2 -> softmax over the last dimension
// (the seed's dim=2 for [observers, 1, 4] batches and dim=1 for [1, 4]).
// Dropout draws from the caller's generator, so runs are reproducible.
struct PolicyImpl : torch::nn::Module {
  PolicyImpl()
      : affine1(register_module("affine1", torch::nn::Linear(4, 128))),
        affine2(register_module("affine2", torch::nn::Linear(128, 2))) {}
  at::Tensor forward(at::Tensor x, at::Generator& gen) {
    constexpr double p = 0.6;
    x = affine1(x);
    x = x * at::empty_like(x).bernoulli_(1 - p, gen) / (1 - p);
    return at::softmax(affine2(at::relu(x)), -1);
  }
  torch::nn::Linear affine1;
  torch::nn::Linear affine2;
};
TORCH_MODULE(Policy);

class Agent;
constexpr char kSelectAction[] = "batch_rpc.Agent.select_action";
constexpr char kSelectActionBatch[] = "batch_rpc.Agent.select_action_batch";


class Observer {
 public:
  Observer(int64_t id, bool batch, int64_t seed, double gamma)
      : id_(id), env_(seed), gamma_(gamma), select_action_(batch ? kSelectActionBatch : kSelectAction) {}

  // Runs n_steps steps (resetting the environment whenever it is done) and
  // returns (returns-to-go per step [n_steps], length of the first episode
  // capped at n_steps, actions received).
  std::tuple<at::Tensor, double, int64_t> run_episode(rpc::RRef<Agent> agent_rref, int64_t n_steps) {
    CartPole::State state = env_.reset();
    std::vector<float> rewards(n_steps, 0.f);
    double ep_reward = static_cast<double>(n_steps);
    int64_t start_step = 0, actions = 0;
    const std::string agent = agent_rref.owner_name();
    for (int64_t step = 0; step < n_steps; ++step) {
      at::Tensor s = at::empty({1, 4}, at::kFloat);
      for (int i = 0; i < 4; ++i) s.data_ptr<float>()[i] = static_cast<float>(state[i]);
      const int64_t action = rpc::rpc_sync<int64_t>(agent, select_action_, agent_rref, id_, s);
      ++actions;
      CartPole::Step r = env_.step(action);
      rewards[step] = static_cast<float>(r.reward);
      state = r.state;
      if (r.done() || step + 1 >= n_steps) {
        double ret = 0;
        for (int64_t i = step; i >= start_step; --i) {
          ret = rewards[i] + gamma_ * ret;
          rewards[i] = static_cast<float>(ret);
        }
        state = env_.reset();
        if (start_step == 0) ep_reward = std::min(ep_reward, static_cast<double>(step - start_step + 1));
        start_step = step + 1;
      }
    }
    at::Tensor out = at::empty({n_steps}, at::kFloat);
    std::copy(rewards.begin(), rewards.end(), out.data_ptr<float>());
    return {out, ep_reward, actions};
  }

 private:
  const int64_t id_;
  CartPole env_;
  const double gamma_;
  const std::string select_action_;
};

class Agent {
 public:
  using Self = rpc::RRef<Agent>;

  Agent(int64_t world_size, bool batch, int64_t seed, double gamma, double lr)
      : batch_(batch), observers_(world_size - 1) {
    at::manual_seed(seed);
    policy_ = Policy();
    optimizer_ = std::make_unique<torch::optim::Adam>(policy_->parameters(), torch::optim::AdamOptions(lr));
    for (int64_t rank = 1; rank < world_size; ++rank) {
      ob_rrefs_.push_back(rpc::remote<Observer>(observer_name(rank), rank - 1, batch,
                                                seed + 1000 * rank, gamma));
    }
    // Batch mode samples all observers at once from one generator; without
    // batching each observer's requests use their own (arrival order varies).
    for (int64_t i = 0; i <= observers_; ++i) gens_.push_back(at::detail::createCPUGenerator(seed + 7 * i + 1));
    absl::MutexLock lock(&mu_);
    reset_episode_state();
  }

  // One observer's state [1, 4] -> its action, at once.
  static int64_t select_action(Self agent_rref, int64_t ob_id, at::Tensor state) {
    std::shared_ptr<Agent> self = agent_rref.local_value();
    self->requests_.fetch_add(1);
    at::Generator& gen = self->gens_.at(ob_id + 1);
    at::Tensor probs = self->policy_->forward(state, gen);  // [1, 2]
    at::Tensor action = at::multinomial(probs, 1, false, gen);  // [1, 1]
    at::Tensor log_prob = at::log(probs.gather(1, action)).reshape(at::IntArrayRef{});  // scalar
    {
      absl::MutexLock lock(&self->mu_);
      self->saved_log_probs_.at(ob_id).push_back(log_prob);
    }
    self->answers_.fetch_add(1);
    return action.item<int64_t>();
  }

  // Async execution: parks the request until every observer has sent its
  // state for this step; the last one runs the policy on all states at once
  // and completes the shared future, answering everyone.
  static rpc::Future<int64_t> select_action_batch(Self agent_rref, int64_t ob_id, at::Tensor state) {
    std::shared_ptr<Agent> self = agent_rref.local_value();
    self->requests_.fetch_add(1);
    rpc::Future<at::Tensor> actions_future;
    rpc::Future<int64_t> future_action;
    at::Tensor actions;
    {
      absl::MutexLock lock(&self->mu_);
      self->states_[ob_id].copy_(state);
      actions_future = self->future_actions_;
      future_action = actions_future.then([self, ob_id](const rpc::Future<at::Tensor>& f) {
        int64_t a = f.value()[ob_id].item<int64_t>();
        self->answers_.fetch_add(1);
        return a;
      });
      if (--self->pending_states_ == 0) {
        self->pending_states_ = self->observers_;
        // A copy: the autograd graph keeps the input, and states_ is
        // overwritten in place by the next step.
        at::Tensor probs = self->policy_->forward(self->states_.clone(), self->gens_[0]);  // [n, 1, 2]
        at::Tensor p2 = probs.view({self->observers_, 2});
        actions = at::multinomial(p2, 1, false, self->gens_[0]);  // [n, 1]
        self->saved_log_probs_[0].push_back(at::log(p2.gather(1, actions)).view({self->observers_}));
        self->future_actions_ = rpc::Future<at::Tensor>();
      }
    }
    if (actions.defined()) actions_future.set_result(actions.view({-1}));
    return future_action;
  }

  // Runs one episode on every observer, then one REINFORCE update. Returns
  // (mean first-episode length, running reward).
  std::tuple<double, double> run_episode(const Self& self, int64_t n_steps,
                                         absl::Duration timeout) {
    std::vector<rpc::Future<std::tuple<at::Tensor, double, int64_t>>> futs;
    for (auto& ob : ob_rrefs_) {
      futs.push_back(ob.rpc_async(rpc::CallOptions{timeout}, &Observer::run_episode,
                                  self, n_steps));
    }
    auto rets = rpc::wait_all(futs);
    std::vector<at::Tensor> per_observer;
    double ep_rewards = 0;
    for (const auto& [rewards, ep_reward, actions] : rets) {
      per_observer.push_back(rewards);
      ep_rewards += ep_reward;
      actions_received_ += actions;
    }
    ep_rewards /= static_cast<double>(rets.size());
    at::Tensor rewards = at::stack(per_observer).t();  // [steps, observers]
    at::Tensor log_probs;
    {
      absl::MutexLock lock(&mu_);
      if (batch_) {
        log_probs = at::stack(saved_log_probs_[0]);  // [steps, observers]
      } else {
        std::vector<at::Tensor> rows;
        for (auto& l : saved_log_probs_) rows.push_back(at::stack(l));
        log_probs = at::stack(rows).t();
      }
      reset_episode_state();
    }
    at::Tensor policy_loss = -log_probs * rewards / static_cast<double>(rets.size());
    policy_loss.sum().backward();
    optimizer_->step();
    optimizer_->zero_grad();
    running_reward_ = 0.5 * ep_rewards + 0.5 * running_reward_;
    return {ep_rewards, running_reward_};
  }

  int64_t requests() const { return requests_.load(); }
  int64_t answers() const { return answers_.load(); }
  int64_t actions_received() const { return actions_received_; }

 private:
  void reset_episode_state() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    saved_log_probs_.assign(batch_ ? 1 : observers_, {});
    states_ = at::zeros({observers_, 1, 4});
    pending_states_ = observers_;
  }

  const bool batch_;
  const int64_t observers_;
  Policy policy_{nullptr};  // forward is safe from several threads
  std::unique_ptr<torch::optim::Adam> optimizer_;  // run_episode's thread only
  std::vector<rpc::RRef<Observer>> ob_rrefs_;
  // [0]: batch sampling; [1 + i]: observer i's requests without batching
  // (one at a time, as each observer waits for its action).
  std::vector<at::Generator> gens_;
  double running_reward_ = 0;
  int64_t actions_received_ = 0;
  std::atomic<int64_t> requests_{0}, answers_{0};
  absl::Mutex mu_;
  // Batch: one [observers] tensor per step; otherwise a list per observer.
  std::vector<std::vector<at::Tensor>> saved_log_probs_ ABSL_GUARDED_BY(mu_);
  at::Tensor states_ ABSL_GUARDED_BY(mu_);  // [observers, 1, 4]
  rpc::Future<at::Tensor> future_actions_ ABSL_GUARDED_BY(mu_);
  int64_t pending_states_ ABSL_GUARDED_BY(mu_) = 0;
};

DDPRPC_REGISTER_FUNCTION_AS(select_action, kSelectAction, &Agent::select_action);
DDPRPC_REGISTER_FUNCTION_AS(select_action_batch, kSelectActionBatch, &Agent::select_action_batch);
static auto observer_registration = rpc::register_class<Observer>("batch_rpc.Observer")
                                        .constructor<int64_t, bool, int64_t, double>()
                                        .method("run_episode", &Observer::run_episode);
static auto agent_registration =
    rpc::register_class<Agent>("batch_rpc.Agent").constructor<int64_t, bool, int64_t, double, double>();

}  // namespace

std::string observer_name(int rank) { return absl::StrCat("observer", rank); }

Figures run_cartpole(int world_size, const CartpoleRun& run) {
  Figures out;
  for (bool batch : {true, false}) {
    const std::string tag = batch ? "batch." : "nobatch.";
    auto agent_rref = rpc::remote<Agent>("agent", int64_t{world_size}, batch, int64_t{run.seed},
                                         run.gamma, run.lr);
    agent_rref.state().created.wait();
    std::shared_ptr<Agent> agent = agent_rref.local_value();
    std::vector<double> rewards, running;
    absl::Time t0 = absl::Now();
    // One line per world size and mode unless on a terminal.
    bench::Progress progress(
        absl::StrFormat("batch_rpc: world %d %s episode", world_size, batch ? "batch" : "no-batch"),
        run.episodes, 1);
    for (int i = 0; i < run.episodes; ++i) {
      auto [last, avg] = agent->run_episode(agent_rref, run.steps, run.timeout);
      rewards.push_back(last);
      running.push_back(avg);
      progress.update(i + 1, absl::StrFormat("last reward %.2f, average reward %.2f", last, avg));
    }
    out[tag + "seconds"] = {absl::ToDoubleSeconds(absl::Now() - t0)};
    out[tag + "rewards"] = rewards;
    out[tag + "running_rewards"] = running;
    out[tag + "requests"] = {static_cast<double>(agent->requests())};
    out[tag + "answers"] = {static_cast<double>(agent->answers())};
    out[tag + "actions_received"] = {static_cast<double>(agent->actions_received())};
    out[tag + "expected"] = {static_cast<double>(int64_t{world_size - 1} * run.steps * run.episodes)};
  }
  return out;
}

}  // namespace ddprpc::benchmarks::batch_rpc
