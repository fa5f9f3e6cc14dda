// batch_rpc: batch RPC processing with async execution
// (PyTorch's batch-RPC tutorial), both halves:
//
// 1. Batch-updating parameter server. The PS's update_and_fetch_model
//    returns an rpc::Future (async execution): each trainer's call adds its
//    gradients and frees its callee thread; the last trainer to arrive runs
//    the optimizer step and completes the shared future, which answers every
//    pending call with the new model. Trainers train a small CNN on random
//    3x32x32 images (batch 20, 30 classes, MSE against one-hot labels).
//    Reported: model updates/s for each trainer count, and the PS's busy
//    callee threads (RpcAgent::busy_worker_threads, sampled every 1 ms),
//    next to a blocking variant that waits on the future inside the call.
// 2. Batch CartPole REINFORCE. One agent, world_size - 1 observers, each
//    stepping its own CartPole-v1 for --steps steps per episode and asking
//    the agent for every action: one at a time (select_action) or batched
//    (select_action_batch, async execution: the last observer to arrive runs
//    the policy once for everyone). Reported per world size: seconds for
//    --episodes episodes with and without batching (as the seed's main()),
//    and the episode rewards (first half vs second half).
//
//   ./bazelw run //benchmarks:batch_rpc -- [--mode=ps|cartpole|all] [--json=batch_rpc.json]
//
// Every configuration runs as fresh processes of this binary
// (benchmarks/harness.h); rank 0 (the PS or the agent) hands its figures
// back to the launcher. Requests and answers are counted on both sides.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/log.h>
#include <ATen/ops/max_pool2d.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/multinomial.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <gflags/gflags.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "benchmarks/common.h"
#include "benchmarks/harness.h"
#include "models/cartpole.h"
#include "rpc/rref/rref.h"

DEFINE_string(mode, "all", "what to run: ps, cartpole or all");
DEFINE_string(trainers, "2,4,8", "PS: trainer counts, comma-separated (one run each)");
DEFINE_int32(iters, 30, "PS: measured iterations per trainer (one model update each)");
DEFINE_int32(warmup, 3, "PS: iterations before measuring");
DEFINE_double(ps_lr, 0.001, "PS: SGD learning rate (momentum 0.9)");
DEFINE_bool(blocking, true,
            "PS: also run update_and_fetch_model without async execution (the call waits on the "
            "future in its callee thread), for comparison");
DEFINE_string(world_sizes, "2..11",
              "CartPole: world sizes (agent + observers) as 'a..b' or comma-separated");
DEFINE_int32(episodes, 10, "CartPole: episodes per world size and mode");
DEFINE_int32(steps, 100, "CartPole: steps per observer per episode (the seed's NUM_STEPS)");
DEFINE_int32(seed, 543, "random seed (policy init, sampling, environments, data)");
DEFINE_double(gamma, 1.0, "CartPole: discount factor");
DEFINE_double(lr, 1e-2, "CartPole: Adam learning rate");
DEFINE_int32(num_worker_threads, 16, "RPC worker threads per process");
DEFINE_int32(timeout_s, 300, "wall-clock limit of each configuration's processes, in seconds");
DEFINE_int32(rpc_timeout_s, 60, "deadline of each RPC, in seconds (training and episodes get --timeout_s)");
DEFINE_string(json, "batch_rpc.json", "where to write the figures");
DEFINE_bool(pytorch, true,
            "also run PyTorch's side (benchmarks/reference/batch_rpc.py with --python: the "
            "tutorial's async_execution parameter server and batch CartPole with the same model, "
            "data sizes, trainer counts and world sizes) and print the ratios");
DEFINE_string(pytorch_script, "",
              "path of PyTorch's side (default: benchmarks/reference/batch_rpc.py from this "
              "binary's runfiles)");
DEFINE_string(task, "", "(internal) what a worker process runs: ps:<trainers> or cartpole:<world>");

namespace rpc = ddprpc::rpc;
namespace bench = ddprpc::benchmarks;
using ddprpc::models::CartPole;

namespace {

// ---------------------------------------------------------------------------
// Figures a run's rank 0 hands to the launcher (benchmarks/harness.h): a
// JSON object of number arrays, non-finite numbers as null.
using Figures = std::map<std::string, std::vector<double>>;

bench::JsonValue figures_json(const Figures& f) {
  bench::JsonValue out;
  auto& fields = *out.mutable_struct_value()->mutable_fields();
  for (const auto& [name, values] : f) {
    auto* list = fields[name].mutable_list_value();
    for (double v : values) {
      if (std::isfinite(v)) {
        list->add_values()->set_number_value(v);
      } else {
        list->add_values()->set_null_value(google::protobuf::NULL_VALUE);
      }
    }
  }
  return out;
}

Figures figures_from(const bench::JsonValue& v) {
  Figures f;
  if (!v.has_struct_value()) return f;
  for (const auto& [name, list] : v.struct_value().fields()) {
    auto& values = f[name];
    for (const auto& x : list.list_value().values()) {
      values.push_back(x.kind_case() == bench::JsonValue::kNumberValue ? x.number_value()
                                                                      : std::nan(""));
    }
  }
  return f;
}

double get(const Figures& f, const std::string& name) {
  auto it = f.find(name);
  return it == f.end() || it->second.empty() ? 0 : it->second[0];
}

// ---------------------------------------------------------------------------
// 1. Batch-updating parameter server.

constexpr int64_t kNumClasses = 30, kBatchSize = 20, kImageSize = 32;

// A small image classifier: conv(3->8) relu pool, conv(8->16) relu pool,
// linear(16*8*8 -> 30).
struct ImageModelImpl : torch::nn::Module {
  ImageModelImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).padding(1)))),
        fc(register_module("fc", torch::nn::Linear(16 * (kImageSize / 4) * (kImageSize / 4), kNumClasses))) {}
  at::Tensor forward(at::Tensor x) {
    x = at::max_pool2d(at::relu(conv1(x)), {2, 2});
    x = at::max_pool2d(at::relu(conv2(x)), {2, 2});
    return fc(x.flatten(1));
  }
  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Linear fc;
};
TORCH_MODULE(ImageModel);

std::vector<at::Tensor> detached_copies(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(t.detach().clone());
  return out;
}

// The PS of the seed: gradients of `batch_update_size` calls are averaged
// into one SGD step; every call is answered with the model after that step.
class BatchUpdateParameterServer {
 public:
  using Self = rpc::RRef<BatchUpdateParameterServer>;

  BatchUpdateParameterServer(int64_t batch_update_size, double lr, int64_t seed)
      : batch_update_size_(batch_update_size) {
    at::manual_seed(seed);
    model_ = ImageModel();
    optimizer_ = std::make_unique<torch::optim::SGD>(
        model_->parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
    for (auto& p : model_->parameters()) p.mutable_grad() = at::zeros_like(p);
  }

  std::vector<at::Tensor> get_model() {
    absl::MutexLock lock(&mu_);
    return detached_copies(model_->parameters());
  }

  // Async execution: returns at once (freeing the callee thread) with a
  // future that completes with the model after the next update.
  static rpc::Future<std::vector<at::Tensor>> update_and_fetch_model(Self ps_rref,
                                                                     std::vector<at::Tensor> grads) {
    std::shared_ptr<BatchUpdateParameterServer> self = ps_rref.local_value();
    rpc::Future<std::vector<at::Tensor>> fut, answer;
    std::vector<at::Tensor> model;
    bool last = false;
    {
      absl::MutexLock lock(&self->mu_);
      std::vector<at::Tensor> params = self->model_->parameters();
      if (grads.size() != params.size()) {
        throw std::invalid_argument(absl::StrCat("update_and_fetch_model: ", grads.size(),
                                                 " gradients for ", params.size(), " parameters"));
      }
      ++self->requests_;
      ++self->curr_update_size_;
      self->max_parked_ = std::max(self->max_parked_, self->curr_update_size_ - 1);
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad().add_(grads[i]);
      // The future of this round, even if the last arriver replaces it.
      fut = self->future_model_;
      answer = fut.then([self](const rpc::Future<std::vector<at::Tensor>>& f) {
        self->answers_.fetch_add(1);
        return f.value();
      });
      if (self->curr_update_size_ >= self->batch_update_size_) {
        // Callee threads held by the other requests of this round (this
        // one excluded): 0 with async execution, batch_update_size - 1 when
        // each waits in its thread.
        self->blocked_at_update_.push_back(rpc::current_agent()->busy_worker_threads() - 1);
        for (auto& p : params) p.mutable_grad().div_(static_cast<double>(self->batch_update_size_));
        self->curr_update_size_ = 0;
        self->optimizer_->step();
        for (auto& p : params) p.mutable_grad().zero_();
        model = detached_copies(params);
        self->update_times_.push_back(absl::Now());
        self->updates_.fetch_add(1);
        self->future_model_ = rpc::Future<std::vector<at::Tensor>>();
        last = true;
      }
    }
    // Outside the lock: completing sends every pending reply from here.
    if (last) fut.set_result(std::move(model));
    return answer;
  }

  // The same without async execution: the callee thread waits for the update.
  static std::vector<at::Tensor> update_and_fetch_model_blocking(Self ps_rref,
                                                                 std::vector<at::Tensor> grads) {
    return update_and_fetch_model(std::move(ps_rref), std::move(grads)).value();
  }

  int64_t updates() const { return updates_.load(); }

  Figures stats(int warmup) {
    absl::MutexLock lock(&mu_);
    Figures f;
    const int n = static_cast<int>(update_times_.size());
    f["updates"] = {static_cast<double>(n)};
    f["requests"] = {static_cast<double>(requests_)};
    f["answers"] = {static_cast<double>(answers_.load())};
    f["max_parked_requests"] = {static_cast<double>(max_parked_)};
    if (static_cast<int>(blocked_at_update_.size()) > warmup) {
      double sum = 0, max = 0;
      for (size_t i = warmup; i < blocked_at_update_.size(); ++i) {
        sum += blocked_at_update_[i];
        max = std::max<double>(max, blocked_at_update_[i]);
      }
      f["blocked_mean"] = {sum / static_cast<double>(blocked_at_update_.size() - warmup)};
      f["blocked_max"] = {max};
    }
    if (n > warmup && warmup >= 1) {
      const double s = absl::ToDoubleSeconds(update_times_[n - 1] - update_times_[warmup - 1]);
      f["updates_per_s"] = {s > 0 ? (n - warmup) / s : 0};
    }
    return f;
  }

 private:
  const int64_t batch_update_size_;
  absl::Mutex mu_;
  ImageModel model_ ABSL_GUARDED_BY(mu_){nullptr};
  std::unique_ptr<torch::optim::SGD> optimizer_ ABSL_GUARDED_BY(mu_);
  rpc::Future<std::vector<at::Tensor>> future_model_ ABSL_GUARDED_BY(mu_);
  int64_t curr_update_size_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t requests_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t max_parked_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<absl::Time> update_times_ ABSL_GUARDED_BY(mu_);
  std::vector<int> blocked_at_update_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> answers_{0}, updates_{0};
};

constexpr char kUpdateAsync[] = "batch_rpc.BatchUpdateParameterServer.update_and_fetch_model";
constexpr char kUpdateBlocking[] =
    "batch_rpc.BatchUpdateParameterServer.update_and_fetch_model_blocking";
DDPRPC_REGISTER_FUNCTION_AS(update_async, kUpdateAsync,
                            &BatchUpdateParameterServer::update_and_fetch_model);
DDPRPC_REGISTER_FUNCTION_AS(update_blocking, kUpdateBlocking,
                            &BatchUpdateParameterServer::update_and_fetch_model_blocking);

class Trainer {
 public:
  Trainer(rpc::RRef<BatchUpdateParameterServer> ps_rref, int64_t seed, bool blocking)
      : ps_rref_(std::move(ps_rref)), blocking_(blocking), gen_(at::detail::createCPUGenerator(seed)) {
    one_hot_indices_ = at::randint(0, kNumClasses, {kBatchSize, 1}, gen_, at::kLong);
  }

  // Trains `iterations` iterations; returns how many updated models came back.
  int64_t train(int64_t iterations) {
    at::set_num_threads(1);
    ImageModel m;
    std::vector<at::Tensor> params = m->parameters();
    load(params, ps_rref_.rpc_sync(&BatchUpdateParameterServer::get_model));
    at::Tensor labels = at::zeros({kBatchSize, kNumClasses}).scatter_(1, one_hot_indices_, 1);
    int64_t received = 0;
    for (int64_t i = 0; i < iterations; ++i) {
      at::Tensor inputs = at::randn({kBatchSize, 3, kImageSize, kImageSize}, gen_);
      for (auto& p : params) p.mutable_grad() = at::Tensor();
      at::mse_loss(m->forward(inputs), labels).backward();
      std::vector<at::Tensor> grads;
      for (auto& p : params) grads.push_back(p.grad());
      load(params, rpc::rpc_sync<std::vector<at::Tensor>>(ps_rref_.owner_name(),
                                                          blocking_ ? kUpdateBlocking : kUpdateAsync,
                                                          ps_rref_, grads));
      ++received;
    }
    return received;
  }

 private:
  static void load(std::vector<at::Tensor>& params, const std::vector<at::Tensor>& values) {
    if (values.size() != params.size()) throw std::runtime_error("Trainer: model size mismatch");
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
  }

  rpc::RRef<BatchUpdateParameterServer> ps_rref_;
  const bool blocking_;
  at::Generator gen_;
  at::Tensor one_hot_indices_;
};

static auto ps_registration =
    rpc::register_class<BatchUpdateParameterServer>("batch_rpc.BatchUpdateParameterServer")
        .constructor<int64_t, double, int64_t>()
        .method("get_model", &BatchUpdateParameterServer::get_model);
static auto trainer_registration = rpc::register_class<Trainer>("batch_rpc.Trainer")
                                       .constructor<rpc::RRef<BatchUpdateParameterServer>, int64_t, bool>()
                                       .method("train", &Trainer::train);

std::string trainer_name(int i) { return absl::StrCat("trainer", i); }

// Rank 0 of a PS run: one run with async execution, then (with --blocking)
// one without, each with a fresh PS and fresh trainers.
Figures run_ps(int trainers) {
  Figures out;
  std::vector<bool> modes = {false};
  if (FLAGS_blocking) modes.push_back(true);
  auto agent = rpc::current_agent();
  for (bool blocking : modes) {
    const std::string tag = blocking ? "blocking." : "async.";
    auto ps = rpc::remote<BatchUpdateParameterServer>("ps", int64_t{trainers}, FLAGS_ps_lr,
                                                      int64_t{FLAGS_seed});
    ps.state().created.wait();
    std::vector<rpc::RRef<Trainer>> ts;
    for (int i = 0; i < trainers; ++i) {
      ts.push_back(rpc::remote<Trainer>(trainer_name(i), ps, int64_t{FLAGS_seed + 1 + i}, blocking));
    }
    std::shared_ptr<BatchUpdateParameterServer> server = ps.local_value();
    std::atomic<bool> stop{false};
    int64_t samples = 0, busy_sum = 0, busy_max = 0;
    // Samples the PS's busy callee threads while measured iterations run.
    std::thread sampler([&] {
      while (!stop.load()) {
        if (server->updates() >= FLAGS_warmup) {
          const int64_t busy = agent->busy_worker_threads();
          ++samples;
          busy_sum += busy;
          busy_max = std::max(busy_max, busy);
        }
        absl::SleepFor(absl::Milliseconds(1));
      }
    });
    const int64_t iterations = FLAGS_warmup + FLAGS_iters;
    std::vector<rpc::Future<int64_t>> futs;
    for (auto& t : ts) {
      futs.push_back(t.rpc_async(rpc::CallOptions{absl::Seconds(FLAGS_timeout_s)}, &Trainer::train, iterations));
    }
    int64_t received = 0;
    for (int64_t r : rpc::wait_all(futs)) received += r;
    stop = true;
    sampler.join();
    for (const auto& [name, values] : server->stats(FLAGS_warmup)) out[tag + name] = values;
    out[tag + "received"] = {static_cast<double>(received)};
    out[tag + "expected"] = {static_cast<double>(trainers * iterations)};
    out[tag + "busy_max"] = {static_cast<double>(busy_max)};
    out[tag + "busy_mean"] = {samples ? static_cast<double>(busy_sum) / samples : 0.0};
    out[tag + "busy_samples"] = {static_cast<double>(samples)};
    std::fprintf(stderr, "batch_rpc: ps, %d trainers, %s: %.1f updates/s\n", trainers,
                 blocking ? "blocking" : "async", get(out, tag + "updates_per_s"));
  }
  return out;
}

// ---------------------------------------------------------------------------
// 2. Batch CartPole REINFORCE.

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

std::string observer_name(int rank) { return absl::StrCat("observer", rank); }

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
  std::tuple<double, double> run_episode(const Self& self, int64_t n_steps) {
    std::vector<rpc::Future<std::tuple<at::Tensor, double, int64_t>>> futs;
    for (auto& ob : ob_rrefs_) {
      futs.push_back(ob.rpc_async(rpc::CallOptions{absl::Seconds(FLAGS_timeout_s)}, &Observer::run_episode,
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

// Rank 0 of a CartPole run: batch mode, then without batching.
Figures run_cartpole(int world_size) {
  Figures out;
  for (bool batch : {true, false}) {
    const std::string tag = batch ? "batch." : "nobatch.";
    auto agent_rref = rpc::remote<Agent>("agent", int64_t{world_size}, batch, int64_t{FLAGS_seed},
                                         FLAGS_gamma, FLAGS_lr);
    agent_rref.state().created.wait();
    std::shared_ptr<Agent> agent = agent_rref.local_value();
    std::vector<double> rewards, running;
    absl::Time t0 = absl::Now();
    // One line per world size and mode unless on a terminal.
    bench::Progress progress(
        absl::StrFormat("batch_rpc: world %d %s episode", world_size, batch ? "batch" : "no-batch"),
        FLAGS_episodes, 1);
    for (int i = 0; i < FLAGS_episodes; ++i) {
      auto [last, avg] = agent->run_episode(agent_rref, FLAGS_steps);
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
    out[tag + "expected"] = {static_cast<double>(int64_t{world_size - 1} * FLAGS_steps * FLAGS_episodes)};
  }
  return out;
}

// ---------------------------------------------------------------------------
// Processes and reporting.

int worker() {
  at::set_num_threads(1);  // many processes share the cores
  const int rank = bench::env_rank();
  std::vector<std::string> task = absl::StrSplit(FLAGS_task, ':');
  int n = 0;
  if (task.size() != 2 || !absl::SimpleAtoi(task[1], &n)) {
    std::fprintf(stderr, "batch_rpc: bad --task '%s'\n", FLAGS_task.c_str());
    return 2;
  }
  const bool ps = task[0] == "ps";
  const int world = ps ? n + 1 : n;
  rpc::RpcBackendOptions options = bench::backend_options();
  options.allow_insecure = bench::allow_insecure();
  options.num_worker_threads = FLAGS_num_worker_threads;
  options.rpc_timeout = absl::Seconds(FLAGS_rpc_timeout_s);
  const std::string name = rank == 0 ? (ps ? "ps" : "agent") : (ps ? trainer_name(rank - 1) : observer_name(rank));
  rpc::init_rpc(name, rank, world, options);
  int rc = 0;
  if (rank == 0) {
    try {
      std::string error;
      if (!bench::write_result(figures_json(ps ? run_ps(n) : run_cartpole(n)), &error)) {
        throw std::runtime_error("cannot hand the figures back: " + error);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "batch_rpc: %s failed on %s: %s\n", FLAGS_task.c_str(), name.c_str(), e.what());
      rc = 1;
    }
  }
  rpc::shutdown(/*graceful=*/rc == 0);
  return rc;
}

// Runs one configuration as fresh processes; false on failure.
bool launch(const std::string& task, int nprocs, int argc, char** argv, Figures* out) {
  bench::RolesOptions launch;
  launch.nprocs = nprocs;
  launch.args = {"--task=" + task};
  launch.timeout = absl::Seconds(FLAGS_timeout_s);
  launch.grace_period = absl::Seconds(10);
  const bench::RolesResult r = bench::run_roles(argc, argv, launch);
  *out = figures_from(r.result);
  if (r.exit_code != 0) {
    std::fprintf(stderr, "batch_rpc: %s failed (rank %d): %s\n", task.c_str(), r.failed_rank,
                 r.message.c_str());
    return false;
  }
  if (!r.has_result) {
    std::fprintf(stderr, "batch_rpc: %s: %s\n", task.c_str(), r.result_error.c_str());
    return false;
  }
  return true;
}

bool parse_list(const std::string& s, std::vector<int>* out) {
  out->clear();
  std::vector<std::string> range = absl::StrSplit(s, "..");
  int a, b;
  if (range.size() == 2 && absl::SimpleAtoi(range[0], &a) && absl::SimpleAtoi(range[1], &b)) {
    for (int i = a; i <= b; ++i) out->push_back(i);
    return !out->empty();
  }
  for (const auto& part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    if (!absl::SimpleAtoi(part, &a)) return false;
    out->push_back(a);
  }
  return !out->empty();
}

double mean(const std::vector<double>& v, size_t begin, size_t end) {
  double s = 0;
  for (size_t i = begin; i < end; ++i) s += v[i];
  return end > begin ? s / static_cast<double>(end - begin) : 0;
}

// "first-half mean -> second-half mean" of episode rewards.
std::pair<double, double> halves(const std::vector<double>& r) {
  const size_t h = r.size() / 2;
  return {mean(r, 0, h), mean(r, h, r.size())};
}

std::string count_cell(double requests, double answers) {
  return absl::StrFormat("%.0f/%.0f", requests, answers);
}

// PyTorch's side, run with this run's configuration: its updates/s per
// trainer count, and its (batch, no-batch) seconds per world size.
struct PytorchFigures {
  std::map<int, double> updates_per_s;
  std::map<int, std::pair<double, double>> cartpole_s;
  bool ran = false;
};

PytorchFigures run_pytorch(const std::string& mode) {
  PytorchFigures out;
  const std::string script = FLAGS_pytorch_script.empty()
                                 ? bench::source_path("benchmarks/reference/batch_rpc.py")
                                 : FLAGS_pytorch_script;
  if (!FLAGS_pytorch || script.empty()) {
    std::printf("\nPyTorch's side not run (--pytorch=false or reference script not found)\n");
    return out;
  }
  std::fprintf(stderr, "batch_rpc: running PyTorch's side (%s)\n", script.c_str());
  const std::string json = bench::temp_path("batch_rpc_pytorch") + ".json";
  std::string output;
  const int rc = bench::run_command(
      {bench::reference_python(), script, "--mode", mode, "--trainers", FLAGS_trainers, "--iters",
       absl::StrCat(FLAGS_iters), "--warmup", absl::StrCat(FLAGS_warmup), "--ps_lr",
       absl::StrCat(FLAGS_ps_lr), "--world_sizes", FLAGS_world_sizes, "--episodes",
       absl::StrCat(FLAGS_episodes), "--steps", absl::StrCat(FLAGS_steps), "--seed",
       absl::StrCat(FLAGS_seed), "--gamma", absl::StrCat(FLAGS_gamma), "--lr",
       absl::StrCat(FLAGS_lr), "--num_worker_threads", absl::StrCat(FLAGS_num_worker_threads),
       "--timeout_s", absl::StrCat(FLAGS_timeout_s), "--json", json},
      &output);
  bench::JsonValue doc;
  std::string error;
  const bool parsed = bench::parse_json(bench::read_file(json), &doc, &error);
  std::remove(json.c_str());
  if (rc != 0 || !parsed) {
    std::printf("\nPyTorch's side failed (exit %d%s):\n%s\n", rc,
                parsed ? "" : (", " + error).c_str(), output.c_str());
    return out;
  }
  out.ran = true;
  if (const bench::JsonValue* ps = bench::json_at(doc, {"ps"})) {
    for (const auto& row : ps->list_value().values()) {
      out.updates_per_s[static_cast<int>(bench::json_number(row, {"trainers"}))] =
          bench::json_number(row, {"updates_per_s"});
    }
  }
  if (const bench::JsonValue* cp = bench::json_at(doc, {"cartpole"})) {
    for (const auto& row : cp->list_value().values()) {
      out.cartpole_s[static_cast<int>(bench::json_number(row, {"world_size"}))] = {
          bench::json_number(row, {"batch_s"}), bench::json_number(row, {"nobatch_s"})};
    }
  }
  return out;
}

std::string ratio_cell(double ours, double theirs, bool higher_is_better) {
  if (ours <= 0 || theirs <= 0) return "-";
  return absl::StrFormat("%.2fx", higher_is_better ? ours / theirs : theirs / ours);
}

int coordinator(int argc, char** argv) {
  std::vector<int> trainer_counts, world_sizes;
  const bool do_ps = FLAGS_mode == "ps" || FLAGS_mode == "all";
  const bool do_cartpole = FLAGS_mode == "cartpole" || FLAGS_mode == "all";
  if (!do_ps && !do_cartpole) {
    std::fprintf(stderr, "batch_rpc: --mode must be ps, cartpole or all\n");
    return 2;
  }
  if ((do_ps && !parse_list(FLAGS_trainers, &trainer_counts)) ||
      (do_cartpole && !parse_list(FLAGS_world_sizes, &world_sizes))) {
    std::fprintf(stderr, "batch_rpc: bad --trainers or --world_sizes\n");
    return 2;
  }
  if (std::any_of(trainer_counts.begin(), trainer_counts.end(), [](int t) { return t < 1; }) ||
      std::any_of(world_sizes.begin(), world_sizes.end(), [](int w) { return w < 2; })) {
    std::fprintf(stderr, "batch_rpc: --trainers must be >= 1 and --world_sizes >= 2\n");
    return 2;
  }
  if (FLAGS_iters < 1 || FLAGS_warmup < 1 || FLAGS_episodes < 1 || FLAGS_steps < 1) {
    std::fprintf(stderr, "batch_rpc: --iters, --warmup, --episodes and --steps must be >= 1\n");
    return 2;
  }
  std::printf("batch_rpc: %d CPUs, seed %d, %d RPC worker threads per process\n", bench::cpu_count(),
              FLAGS_seed, FLAGS_num_worker_threads);
  std::printf("batch_rpc: %s\n", bench::versions().c_str());
  bench::Json json;
  json.begin_object();
  json.key("config").begin_object();
  json.key("cpus").value(bench::cpu_count()).key("seed").value(FLAGS_seed);
  json.versions();
  json.key("num_worker_threads").value(FLAGS_num_worker_threads);
  json.key("ps_iters").value(FLAGS_iters).key("ps_warmup").value(FLAGS_warmup);
  json.key("ps_lr").value(FLAGS_ps_lr).key("episodes").value(FLAGS_episodes);
  json.key("steps").value(FLAGS_steps).key("gamma").value(FLAGS_gamma).key("lr").value(FLAGS_lr);
  json.end_object();
  bool ok = true;
  std::map<int, double> our_updates_per_s;                   // async execution
  std::map<int, std::pair<double, double>> our_cartpole_s;  // batch, no-batch

  if (do_ps) {
    std::printf("\nBatch-updating parameter server: small CNN (3x32x32, batch %lld, %lld classes), "
                "%d measured + %d warm-up iterations per trainer\n",
                static_cast<long long>(kBatchSize), static_cast<long long>(kNumClasses), FLAGS_iters,
                FLAGS_warmup);
    std::fflush(stdout);
    bench::Table table({"trainers", "update_and_fetch_model", "updates/s", "grads/s",
                        "blocked at update mean", "max", "busy sampled mean", "max",
                        "requests/answers"});
    json.key("ps").begin_array();
    for (int t : trainer_counts) {
      Figures f;
      std::fprintf(stderr, "batch_rpc: parameter server with %d trainers\n", t);
      if (!launch(absl::StrCat("ps:", t), t + 1, argc, argv, &f)) {
        ok = false;
        continue;
      }
      for (const char* mode : {"async", "blocking"}) {
        const std::string tag = std::string(mode) + ".";
        if (!f.count(tag + "updates")) continue;
        const double ups = get(f, tag + "updates_per_s");
        if (std::string(mode) == "async") our_updates_per_s[t] = ups;
        table.add({absl::StrCat(t), std::string(mode) == "async" ? "async execution" : "blocking",
                   absl::StrFormat("%.1f", ups), absl::StrFormat("%.1f", ups * t),
                   absl::StrFormat("%.2f", get(f, tag + "blocked_mean")),
                   absl::StrFormat("%.0f", get(f, tag + "blocked_max")),
                   absl::StrFormat("%.2f", get(f, tag + "busy_mean")),
                   absl::StrFormat("%.0f", get(f, tag + "busy_max")),
                   count_cell(get(f, tag + "requests"), get(f, tag + "answers"))});
        json.begin_object();
        json.key("trainers").value(t).key("mode").value(mode);
        json.key("updates_per_s").value(ups).key("grads_per_s").value(ups * t);
        json.key("updates").value(get(f, tag + "updates"));
        json.key("blocked_threads_at_update_mean").value(get(f, tag + "blocked_mean"));
        json.key("blocked_threads_at_update_max").value(get(f, tag + "blocked_max"));
        json.key("busy_threads_max").value(get(f, tag + "busy_max"));
        json.key("busy_threads_mean").value(get(f, tag + "busy_mean"));
        json.key("busy_samples").value(get(f, tag + "busy_samples"));
        json.key("max_parked_requests").value(get(f, tag + "max_parked_requests"));
        json.key("requests").value(get(f, tag + "requests"));
        json.key("answers").value(get(f, tag + "answers"));
        json.key("models_received").value(get(f, tag + "received"));
        json.key("expected").value(get(f, tag + "expected"));
        json.end_object();
      }
    }
    json.end_array();
    std::printf("%s", table.str().c_str());
    std::printf("blocked at update: callee threads the other trainers' calls held on the PS when the "
                "last one arrived\n(should stay near 0 with async execution); busy sampled: "
                "RpcAgent::busy_worker_threads() every 1 ms\n");
    std::fflush(stdout);
  }

  if (do_cartpole) {
    std::printf("\nBatch CartPole REINFORCE: %d episodes x %d steps per observer, seed %d\n",
                FLAGS_episodes, FLAGS_steps, FLAGS_seed);
    std::fflush(stdout);
    bench::Table table({"world size", "batch s", "no-batch s", "speedup", "batch reward",
                        "no-batch reward", "batch req/ans", "no-batch req/ans"});
    std::string csv;
    json.key("cartpole").begin_array();
    for (int w : world_sizes) {
      Figures f;
      std::fprintf(stderr, "batch_rpc: CartPole with world size %d\n", w);
      if (!launch(absl::StrCat("cartpole:", w), w, argc, argv, &f) || !f.count("batch.seconds") ||
          !f.count("nobatch.seconds")) {
        ok = false;
        continue;
      }
      const double b = get(f, "batch.seconds"), nb = get(f, "nobatch.seconds");
      our_cartpole_s[w] = {b, nb};
      auto [b0, b1] = halves(f["batch.rewards"]);
      auto [n0, n1] = halves(f["nobatch.rewards"]);
      table.add({absl::StrCat(w), absl::StrFormat("%.3f", b), absl::StrFormat("%.3f", nb),
                 absl::StrFormat("%.2fx", b > 0 ? nb / b : 0), absl::StrFormat("%.1f -> %.1f", b0, b1),
                 absl::StrFormat("%.1f -> %.1f", n0, n1),
                 count_cell(get(f, "batch.requests"), get(f, "batch.answers")),
                 count_cell(get(f, "nobatch.requests"), get(f, "nobatch.answers"))});
      absl::StrAppendFormat(&csv, "%d, %.4f, %.4f\n", w, b, nb);
      json.begin_object();
      json.key("world_size").value(w);
      for (const char* mode : {"batch", "nobatch"}) {
        const std::string tag = std::string(mode) + ".";
        json.key(mode).begin_object();
        json.key("seconds").value(get(f, tag + "seconds"));
        for (const char* series : {"rewards", "running_rewards"}) {
          json.key(series).begin_array();
          for (double v : f[tag + series]) json.value(v);
          json.end_array();
        }
        for (const char* count : {"requests", "answers", "actions_received", "expected"}) {
          json.key(count).value(get(f, tag + count));
        }
        json.end_object();
      }
      json.end_object();
    }
    json.end_array();
    std::printf("%s", table.str().c_str());
    std::printf("reward: mean first-episode length (capped at --steps), first half of the episodes "
                "-> second half\nworld_size, batch seconds, no-batch seconds (the seed's output):\n%s",
                csv.c_str());
  }
  const PytorchFigures theirs = run_pytorch(FLAGS_mode);
  if (theirs.ran) {
    std::printf("\n------------------ PyTorch (same machine, same run) ---------------------\n");
    json.key("pytorch").begin_object();
    if (do_ps) {
      std::printf("Parameter server, async execution on both sides (@rpc.functions.async_execution):\n");
      bench::Table table({"trainers", "ddprpc updates/s", "PyTorch updates/s", "ddprpc vs PyTorch"});
      json.key("ps").begin_array();
      for (int t : trainer_counts) {
        const double ours = our_updates_per_s.count(t) ? our_updates_per_s[t] : 0;
        const double pt = theirs.updates_per_s.count(t) ? theirs.updates_per_s.at(t) : 0;
        table.add({absl::StrCat(t), absl::StrFormat("%.1f", ours), absl::StrFormat("%.1f", pt),
                   ratio_cell(ours, pt, true)});
        json.begin_object().key("trainers").value(t).key("updates_per_s").value(pt);
        json.key("ddprpc_vs_pytorch").value(ours > 0 && pt > 0 ? ours / pt : 0.0).end_object();
      }
      json.end_array();
      std::printf("%s", table.str().c_str());
    }
    if (do_cartpole) {
      std::printf("CartPole, seconds for %d episodes (lower is better; ratio = PyTorch s / ddprpc s):\n",
                  FLAGS_episodes);
      bench::Table table({"world size", "ddprpc batch s", "PyTorch batch s", "ratio",
                          "ddprpc no-batch s", "PyTorch no-batch s", "ratio"});
      json.key("cartpole").begin_array();
      for (int w : world_sizes) {
        const auto ours = our_cartpole_s.count(w) ? our_cartpole_s[w] : std::make_pair(0.0, 0.0);
        const auto pt = theirs.cartpole_s.count(w) ? theirs.cartpole_s.at(w) : std::make_pair(0.0, 0.0);
        table.add({absl::StrCat(w), absl::StrFormat("%.3f", ours.first),
                   absl::StrFormat("%.3f", pt.first), ratio_cell(ours.first, pt.first, false),
                   absl::StrFormat("%.3f", ours.second), absl::StrFormat("%.3f", pt.second),
                   ratio_cell(ours.second, pt.second, false)});
        json.begin_object().key("world_size").value(w);
        json.key("batch_s").value(pt.first).key("nobatch_s").value(pt.second).end_object();
      }
      json.end_array();
      std::printf("%s", table.str().c_str());
    }
    json.end_object();
  }
  json.end_object();
  const std::string path = bench::output_path(FLAGS_json);
  if (json.write(path)) std::printf("wrote %s\n", path.c_str());
  return ok ? 0 : 1;
}

}  // namespace

// After main's one-time set-up; also where ranks forked by run_roles start.
int rank_main(int argc, char** argv) {
  bench::keep_freed_memory();
  bench::parse_flags(&argc, &argv, "benchmarks/batch_rpc");
  if (bench::env_rank() >= 0) return worker();
  return coordinator(argc, argv);
}

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "batch RPC with async execution: a batch-updating parameter server and batch CartPole "
      "REINFORCE\n  usage: batch_rpc [--mode=ps|cartpole|all] [--trainers=2,4,8] "
      "[--world_sizes=2..11] [--json=batch_rpc.json]");
  return bench::run_main(argc, argv, &rank_main);
}
