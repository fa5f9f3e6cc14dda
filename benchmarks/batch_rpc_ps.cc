#include "benchmarks/batch_rpc_ps.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/max_pool2d.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

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

namespace ddprpc::benchmarks::batch_rpc {
namespace {

namespace bench = ::ddprpc::benchmarks;

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

}  // namespace

std::string trainer_name(int i) { return absl::StrCat("trainer", i); }

Figures run_ps(int trainers, const PsRun& run) {
  Figures out;
  std::vector<bool> modes = {false};
  if (run.blocking) modes.push_back(true);
  auto agent = rpc::current_agent();
  for (bool blocking : modes) {
    const std::string tag = blocking ? "blocking." : "async.";
    auto ps = rpc::remote<BatchUpdateParameterServer>("ps", int64_t{trainers}, run.lr,
                                                      int64_t{run.seed});
    ps.state().created.wait();
    std::vector<rpc::RRef<Trainer>> ts;
    for (int i = 0; i < trainers; ++i) {
      ts.push_back(rpc::remote<Trainer>(trainer_name(i), ps, int64_t{run.seed + 1 + i}, blocking));
    }
    std::shared_ptr<BatchUpdateParameterServer> server = ps.local_value();
    std::atomic<bool> stop{false};
    int64_t samples = 0, busy_sum = 0, busy_max = 0;
    // Samples the PS's busy callee threads while measured iterations run.
    std::thread sampler([&] {
      while (!stop.load()) {
        if (server->updates() >= run.warmup) {
          const int64_t busy = agent->busy_worker_threads();
          ++samples;
          busy_sum += busy;
          busy_max = std::max(busy_max, busy);
        }
        absl::SleepFor(absl::Milliseconds(1));
      }
    });
    const int64_t iterations = run.warmup + run.iters;
    std::vector<rpc::Future<int64_t>> futs;
    for (auto& t : ts) {
      futs.push_back(t.rpc_async(rpc::CallOptions{run.timeout}, &Trainer::train, iterations));
    }
    int64_t received = 0;
    for (int64_t r : rpc::wait_all(futs)) received += r;
    stop = true;
    sampler.join();
    for (const auto& [name, values] : server->stats(static_cast<int>(run.warmup))) out[tag + name] = values;
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

}  // namespace ddprpc::benchmarks::batch_rpc
