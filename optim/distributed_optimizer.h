// optim::DistributedOptimizer, mirroring torch.distributed.optim:
//
//   optim::DistributedOptimizer opt("sgd", {{"lr", 0.05}}, param_rrefs);
//   opt.step(context_id);   // inside dist_autograd::Context
//
// A step changes each parameter it updates in place, as torch.optim's
// update does: the parameter's version counter (_version()) grows with
// every step applied to it, by exactly one for "sgd".
//
// Parameters are RRef<at::Tensor>s that may live on any worker. One local
// torch::optim optimizer is created per owner (by rpc::remote); step() runs
// all of them in parallel with that context's gradients and throws the first
// owner's error. Steps of different optimizers on one worker are serialized,
// since they may share parameters (e.g. an embedding table updated by
// several trainers).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "autograd/dist_autograd.h"
#include "rpc/rref/rref.h"

namespace ddprpc::optim {

class LocalOptimizer;

class DistributedOptimizer {
 public:
  // kind (options; defaults as torch.optim's):
  //   "sgd"      lr, momentum, dampening, weight_decay, nesterov
  //   "adam"     lr, beta1, beta2, eps, weight_decay, amsgrad
  //   "adamw"    lr, beta1, beta2, eps, weight_decay (0.01), amsgrad
  //   "adagrad"  lr, lr_decay, weight_decay, initial_accumulator_value, eps
  //   "rmsprop"  lr, alpha, eps, weight_decay, momentum, centered
  //   "adadelta" lr (1.0), rho, eps, weight_decay
  //   "adamax"   lr (0.002), beta1, beta2, eps, weight_decay
  //   "rprop"    lr, etaminus, etaplus, step_min, step_max
  // Parameters that got no gradient in a context are left unchanged.
  // Unknown kinds or options fail on the owners with a clear error.
  DistributedOptimizer(const std::string& kind, const std::map<std::string, double>& options,
                       const std::vector<rpc::RRef<at::Tensor>>& params);

  // Steps every owner's optimizer with the context's gradients there. If
  // some fail, it waits for all of them before it throws, and the error
  // names the owners that failed and those that applied the step.
  void step(dist_autograd::ContextId context_id);

 private:
  std::vector<rpc::RRef<LocalOptimizer>> optimizers_;
};

// Runs `fn` while no LocalOptimizer of this process applies a step: what
// it reads of parameters that optimizers update (a checkpoint's copy, say)
// is whole steps, never part of one. `fn` must not step an optimizer.
void without_steps(const std::function<void()>& fn);

// The per-owner part (created remotely by DistributedOptimizer).
class LocalOptimizer {
 public:
  LocalOptimizer(std::string kind, std::vector<std::string> option_names,
                 std::vector<double> option_values, std::vector<rpc::RRef<at::Tensor>> params);
  ~LocalOptimizer();
  // Applies the gradients of `context_id` on this worker.
  int64_t step(int64_t context_id);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddprpc::optim
