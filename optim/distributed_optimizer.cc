#include "optim/distributed_optimizer.h"

#include <ATen/ops/full_like.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cmath>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

// One optimizer's update of the owner's parameters; parameters without a
// gradient in a step are left as they are (state included), as
// torch.optim's optimizers do.
class UpdateRule {
 public:
  virtual ~UpdateRule() = default;
  virtual void step() = 0;
};

// A libtorch optimizer.
class TorchRule : public UpdateRule {
 public:
  explicit TorchRule(std::unique_ptr<torch::optim::Optimizer> optimizer)
      : optimizer_(std::move(optimizer)) {}
  void step() override { optimizer_->step(); }

 private:
  const std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

// Rules libtorch's C++ API lacks, written after torch.optim's (1.13)
// single-tensor formulas. State per parameter, made at its first gradient.
class OwnRule : public UpdateRule {
 public:
  explicit OwnRule(std::vector<at::Tensor> params) : params_(std::move(params)), state_(params_.size()) {}
  void step() override {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& grad = params_[i].grad();
      if (!grad.defined()) continue;
      if (state_[i].empty()) state_[i] = init(params_[i]);
      update(params_[i], grad, state_[i]);
    }
  }

 protected:
  virtual std::vector<at::Tensor> init(const at::Tensor& param) = 0;
  virtual void update(const at::Tensor& param, const at::Tensor& grad, std::vector<at::Tensor>& state) = 0;

 private:
  const std::vector<at::Tensor> params_;
  std::vector<std::vector<at::Tensor>> state_;
};

class Adadelta : public OwnRule {
 public:
  Adadelta(std::vector<at::Tensor> params, double lr, double rho, double eps, double weight_decay)
      : OwnRule(std::move(params)), lr_(lr), rho_(rho), eps_(eps), weight_decay_(weight_decay) {}

 private:
  std::vector<at::Tensor> init(const at::Tensor& p) override {
    return {at::zeros_like(p), at::zeros_like(p)};  // square_avg, acc_delta
  }
  void update(const at::Tensor& p, const at::Tensor& g, std::vector<at::Tensor>& s) override {
    at::Tensor grad = weight_decay_ != 0 ? g.add(p, weight_decay_) : g;
    s[0].mul_(rho_).addcmul_(grad, grad, 1 - rho_);
    at::Tensor delta = s[1].add(eps_).sqrt_().div_(s[0].add(eps_).sqrt_()).mul_(grad);
    s[1].mul_(rho_).addcmul_(delta, delta, 1 - rho_);
    p.add_(delta, -lr_);
  }
  const double lr_, rho_, eps_, weight_decay_;
};

class Adamax : public OwnRule {
 public:
  Adamax(std::vector<at::Tensor> params, double lr, double beta1, double beta2, double eps,
         double weight_decay)
      : OwnRule(std::move(params)), lr_(lr), beta1_(beta1), beta2_(beta2), eps_(eps),
        weight_decay_(weight_decay) {}

 private:
  std::vector<at::Tensor> init(const at::Tensor& p) override {
    // exp_avg, exp_inf, step count (a scalar tensor)
    return {at::zeros_like(p), at::zeros_like(p), at::zeros({}, at::kDouble)};
  }
  void update(const at::Tensor& p, const at::Tensor& g, std::vector<at::Tensor>& s) override {
    at::Tensor grad = weight_decay_ != 0 ? g.add(p, weight_decay_) : g;
    const double step = s[2].add_(1).item<double>();
    s[0].mul_(beta1_).add_(grad, 1 - beta1_);
    s[1] = at::maximum(s[1].mul(beta2_), grad.abs().add_(eps_));
    const double clr = lr_ / (1 - std::pow(beta1_, step));
    p.addcdiv_(s[0], s[1], -clr);
  }
  const double lr_, beta1_, beta2_, eps_, weight_decay_;
};

class Rprop : public OwnRule {
 public:
  Rprop(std::vector<at::Tensor> params, double lr, double etaminus, double etaplus,
        double step_min, double step_max)
      : OwnRule(std::move(params)), lr_(lr), etaminus_(etaminus), etaplus_(etaplus),
        step_min_(step_min), step_max_(step_max) {}

 private:
  std::vector<at::Tensor> init(const at::Tensor& p) override {
    return {at::zeros_like(p), at::full_like(p, lr_)};  // prev, step_size
  }
  void update(const at::Tensor& p, const at::Tensor& g, std::vector<at::Tensor>& s) override {
    at::Tensor sign = g.mul(s[0]).sign();
    at::Tensor factor = at::where(sign.gt(0), at::full_like(sign, etaplus_),
                                  at::where(sign.lt(0), at::full_like(sign, etaminus_),
                                            at::ones_like(sign)));
    s[1].mul_(factor).clamp_(step_min_, step_max_);
    // Where the gradient's sign flipped: no step now, and no flip seen next time.
    at::Tensor grad = at::where(sign.lt(0), at::zeros_like(g), g);
    p.addcmul_(grad.sign(), s[1], -1);
    s[0] = grad.clone();
  }
  const double lr_, etaminus_, etaplus_, step_min_, step_max_;
};

std::unique_ptr<UpdateRule> make_rule(const std::string& kind, std::map<std::string, double> o,
                                      std::vector<at::Tensor> params) {
  std::unique_ptr<UpdateRule> rule;
  auto torch_rule = [](auto optimizer) {
    return std::make_unique<TorchRule>(std::move(optimizer));
  };
  if (kind == "sgd") {
    torch::optim::SGDOptions so(take(o, "lr", 0.01));
    so.momentum(take(o, "momentum", 0)).dampening(take(o, "dampening", 0));
    so.weight_decay(take(o, "weight_decay", 0)).nesterov(take(o, "nesterov", 0) != 0);
    rule = torch_rule(std::make_unique<torch::optim::SGD>(params, so));
  } else if (kind == "adam" || kind == "adamw") {
    const double lr = take(o, "lr", 1e-3);
    const double beta1 = take(o, "beta1", 0.9), beta2 = take(o, "beta2", 0.999);
    const double eps = take(o, "eps", 1e-8);
    const double weight_decay = take(o, "weight_decay", kind == "adamw" ? 1e-2 : 0);
    const bool amsgrad = take(o, "amsgrad", 0) != 0;
    if (kind == "adam") {
      torch::optim::AdamOptions ao(lr);
      ao.betas({beta1, beta2}).eps(eps).weight_decay(weight_decay).amsgrad(amsgrad);
      rule = torch_rule(std::make_unique<torch::optim::Adam>(params, ao));
    } else {
      torch::optim::AdamWOptions ao(lr);
      ao.betas({beta1, beta2}).eps(eps).weight_decay(weight_decay).amsgrad(amsgrad);
      rule = torch_rule(std::make_unique<torch::optim::AdamW>(params, ao));
    }
  } else if (kind == "adagrad") {
    torch::optim::AdagradOptions ao(take(o, "lr", 1e-2));
    ao.lr_decay(take(o, "lr_decay", 0)).weight_decay(take(o, "weight_decay", 0));
    ao.initial_accumulator_value(take(o, "initial_accumulator_value", 0)).eps(take(o, "eps", 1e-10));
    rule = torch_rule(std::make_unique<torch::optim::Adagrad>(params, ao));
  } else if (kind == "rmsprop") {
    torch::optim::RMSpropOptions ro(take(o, "lr", 1e-2));
    ro.alpha(take(o, "alpha", 0.99)).eps(take(o, "eps", 1e-8));
    ro.weight_decay(take(o, "weight_decay", 0)).momentum(take(o, "momentum", 0));
    ro.centered(take(o, "centered", 0) != 0);
    rule = torch_rule(std::make_unique<torch::optim::RMSprop>(params, ro));
  } else if (kind == "adadelta") {
    const double lr = take(o, "lr", 1.0), rho = take(o, "rho", 0.9);
    const double eps = take(o, "eps", 1e-6), wd = take(o, "weight_decay", 0);
    rule = std::make_unique<Adadelta>(params, lr, rho, eps, wd);
  } else if (kind == "adamax") {
    const double lr = take(o, "lr", 2e-3), beta1 = take(o, "beta1", 0.9);
    const double beta2 = take(o, "beta2", 0.999), eps = take(o, "eps", 1e-8);
    const double wd = take(o, "weight_decay", 0);
    rule = std::make_unique<Adamax>(params, lr, beta1, beta2, eps, wd);
  } else if (kind == "rprop") {
    const double lr = take(o, "lr", 1e-2), etaminus = take(o, "etaminus", 0.5);
    const double etaplus = take(o, "etaplus", 1.2), step_min = take(o, "step_min", 1e-6);
    const double step_max = take(o, "step_max", 50);
    rule = std::make_unique<Rprop>(params, lr, etaminus, etaplus, step_min, step_max);
  } else {
    throw std::invalid_argument("DistributedOptimizer: unknown optimizer '" + kind +
                                "' (use sgd, adam, adamw, adagrad, rmsprop, adadelta, adamax "
                                "or rprop)");
  }
  if (!o.empty()) {
    throw std::invalid_argument("DistributedOptimizer: unknown option '" + o.begin()->first +
                                "' for " + kind);
  }
  return rule;
}

}  // namespace

struct LocalOptimizer::Impl {
  std::vector<at::Tensor> params;
  std::unique_ptr<UpdateRule> optimizer;
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
  impl_->optimizer = make_rule(kind, std::move(options), impl_->params);
}

LocalOptimizer::~LocalOptimizer() = default;

void without_steps(const std::function<void()>& fn) {
  absl::MutexLock lock(&g_step_mu);
  fn();
}

int64_t LocalOptimizer::step(int64_t context_id) {
  c10::Dict<at::Tensor, at::Tensor> grads = dist_autograd::get_gradients(context_id);
  absl::MutexLock lock(&g_step_mu);
  int64_t applied = 0;
  // Each parameter's version before the step (-1: no gradient).
  std::vector<int64_t> versions(impl_->params.size(), -1);
  for (size_t i = 0; i < impl_->params.size(); ++i) {
    at::Tensor& p = impl_->params[i];
    auto it = grads.find(p);
    if (it != grads.end()) {
      p.mutable_grad() = it->value();
      versions[i] = p._version();
      ++applied;
    } else {
      p.mutable_grad() = at::Tensor();
    }
  }
  // The gradients leave the parameters whatever the step does.
  absl::Cleanup drop_grads = [this] {
    for (at::Tensor& p : impl_->params) p.mutable_grad() = at::Tensor();
  };
  impl_->optimizer->step();
  // Some of torch::optim's rules update through .data(), which leaves the
  // parameter's version counter as it was; a step counts at least once, as
  // torch.optim's in-place update counts.
  for (size_t i = 0; i < impl_->params.size(); ++i) {
    at::Tensor& p = impl_->params[i];
    if (versions[i] >= 0 && p._version() == versions[i]) p.unsafeGetTensorImpl()->bump_version();
    p.mutable_grad() = at::Tensor();
  }
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
  const std::shared_ptr<rpc::RpcAgent> agent = rpc::current_agent();  // throws once shut down
  std::vector<rpc::Future<int64_t>> steps;
  std::vector<int> owners;  // of steps
  const LocalOptimizer* local = nullptr;
  rpc::SyncCallScope waited_here;  // this thread reads the replies
  for (const auto& opt : optimizers_) {
    if (opt.is_owner()) {
      local = opt.local_value().get();  // this worker's parameters: no RPC
    } else {
      steps.push_back(opt.rpc_async(&LocalOptimizer::step, context_id));
      owners.push_back(opt.state().owner);
    }
  }
  std::vector<std::string> failed, applied;
  auto name = [&agent](int owner) { return agent->worker(owner).name; };
  if (local) {
    try {
      const_cast<LocalOptimizer*>(local)->step(context_id);
      applied.push_back(agent->self().name);
    } catch (const std::exception& e) {
      failed.push_back(absl::StrCat(agent->self().name, " (", e.what(), ")"));
    }
  }
  // Every owner's step is waited for, failed or not: the error says which
  // owners applied it, so that none is stepped twice by a retry unawares.
  for (size_t i = 0; i < steps.size(); ++i) {
    try {
      steps[i].value();
      applied.push_back(name(owners[i]));
    } catch (const std::exception& e) {
      failed.push_back(absl::StrCat(name(owners[i]), " (", e.what(), ")"));
    }
  }
  if (!failed.empty()) {
    throw std::runtime_error(absl::StrCat(
        "DistributedOptimizer::step in context ", context_id, " failed on ",
        absl::StrJoin(failed, ", "), "; applied on ",
        applied.empty() ? std::string("none") : absl::StrJoin(applied, ", ")));
  }
}

}  // namespace ddprpc::optim
