#include "optim/distributed_optimizer.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "absl/synchronization/mutex.h"

namespace ddprpc::optim {
namespace {

// Serializes local steps: optimizers of different trainers share parameters.
absl::Mutex g_step_mu;

double take(std::map<std::string, double>& options, const std::string& key, double fallback) {
  auto it = options.find(key);
  if (it == options.end()) return fallback;
  double v = it->second;
  options.erase(it);
  return v;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                        std::map<std::string, double> o,
                                                        std::vector<at::Tensor> params) {
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (kind == "sgd") {
    torch::optim::SGDOptions so(take(o, "lr", 0.01));
    so.momentum(take(o, "momentum", 0)).dampening(take(o, "dampening", 0));
    so.weight_decay(take(o, "weight_decay", 0)).nesterov(take(o, "nesterov", 0) != 0);
    opt = std::make_unique<torch::optim::SGD>(params, so);
  } else if (kind == "adam") {
    torch::optim::AdamOptions ao(take(o, "lr", 1e-3));
    ao.betas({take(o, "beta1", 0.9), take(o, "beta2", 0.999)}).eps(take(o, "eps", 1e-8));
    ao.weight_decay(take(o, "weight_decay", 0)).amsgrad(take(o, "amsgrad", 0) != 0);
    opt = std::make_unique<torch::optim::Adam>(params, ao);
  } else if (kind == "adagrad") {
    torch::optim::AdagradOptions ao(take(o, "lr", 1e-2));
    ao.lr_decay(take(o, "lr_decay", 0)).weight_decay(take(o, "weight_decay", 0));
    ao.initial_accumulator_value(take(o, "initial_accumulator_value", 0)).eps(take(o, "eps", 1e-10));
    opt = std::make_unique<torch::optim::Adagrad>(params, ao);
  } else {
    throw std::invalid_argument("DistributedOptimizer: unknown optimizer '" + kind +
                                "' (use sgd, adam or adagrad)");
  }
  if (!o.empty()) {
    throw std::invalid_argument("DistributedOptimizer: unknown option '" + o.begin()->first +
                                "' for " + kind);
  }
  return opt;
}

}  // namespace

struct LocalOptimizer::Impl {
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
};

LocalOptimizer::LocalOptimizer(std::string kind, std::vector<std::string> option_names,
                               std::vector<double> option_values,
                               std::vector<rpc::RRef<at::Tensor>> params)
    : impl_(std::make_unique<Impl>()) {
  std::map<std::string, double> options;
  for (size_t i = 0; i < option_names.size() && i < option_values.size(); ++i) {
    options[option_names[i]] = option_values[i];
  }
  for (const auto& p : params) impl_->params.push_back(p.local_value());
  impl_->optimizer = make_optimizer(kind, std::move(options), impl_->params);
}

LocalOptimizer::~LocalOptimizer() = default;

int64_t LocalOptimizer::step(int64_t context_id) {
  c10::Dict<at::Tensor, at::Tensor> grads = dist_autograd::get_gradients(context_id);
  absl::MutexLock lock(&g_step_mu);
  int64_t applied = 0;
  for (at::Tensor& p : impl_->params) {
    auto it = grads.find(p);
    if (it != grads.end()) {
      p.mutable_grad() = it->value();
      ++applied;
    } else {
      p.mutable_grad() = at::Tensor();
    }
  }
  impl_->optimizer->step();
  for (at::Tensor& p : impl_->params) p.mutable_grad() = at::Tensor();
  return applied;
}

static auto local_optimizer_registration =
    rpc::register_class<LocalOptimizer>("ddprpc.optim.LocalOptimizer")
        .constructor<std::string, std::vector<std::string>, std::vector<double>,
                     std::vector<rpc::RRef<at::Tensor>>>()
        .method("step", &LocalOptimizer::step);

DistributedOptimizer::DistributedOptimizer(const std::string& kind,
                                           const std::map<std::string, double>& options,
                                           const std::vector<rpc::RRef<at::Tensor>>& params) {
  std::map<int, std::vector<rpc::RRef<at::Tensor>>> by_owner;
  for (const auto& p : params) by_owner[p.state().owner].push_back(p);
  std::vector<std::string> names;
  std::vector<double> values;
  for (const auto& [k, v] : options) {
    names.push_back(k);
    values.push_back(v);
  }
  auto agent = rpc::current_agent();
  for (auto& [owner, owned] : by_owner) {
    optimizers_.push_back(
        rpc::remote<LocalOptimizer>(agent->worker(owner).name, kind, names, values, owned));
  }
}

void DistributedOptimizer::step(dist_autograd::ContextId context_id) {
  std::vector<rpc::Future<int64_t>> steps;
  const LocalOptimizer* local = nullptr;
  rpc::SyncCallScope waited_here;  // this thread reads the replies
  for (const auto& opt : optimizers_) {
    if (opt.is_owner()) {
      local = opt.local_value().get();  // this worker's parameters: no RPC
    } else {
      steps.push_back(opt.rpc_async(&LocalOptimizer::step, context_id));
    }
  }
  if (local) const_cast<LocalOptimizer*>(local)->step(context_id);
  rpc::wait_all(steps);
}

}  // namespace ddprpc::optim
