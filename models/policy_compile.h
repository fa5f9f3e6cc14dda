// Turns a PpoPolicy into a faster inference module, selected as backend +
// mode (like torch.compile's backend/mode in the seed):
//
//   backend      modes      what it does
//   torchscript  script     the policy as a TorchScript module
//                freeze     + torch::jit::freeze
//                optimize   + freeze + optimize_for_inference (oneDNN paths)
//   xnnpack      default    freeze + optimizeForMobile: prepacked XNNPACK
//                           linear/conv (as optimize_for_mobile does)
//   nnc          default    TorchScript with the TensorExpr fuser on (this
//                           libtorch has no LLVM: fusion falls back unfused)
//
// Compiled modules give the same logits as eager (up to float rounding).
// A backend that cannot handle a model throws std::runtime_error naming
// both. Threads: XNNPACK's thread pool and OpenMP's spin-waiting threads
// fight on small machines (batch 16 on 2 threads fell to ~60 calls/s), so
// the safe default (DefaultThreads) is one intra-op thread for compiled
// policies; set_policy_threads() applies a choice to both pools.
#pragma once

#include <torch/script.h>

#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "models/ppo_policy.h"

namespace ddprpc::models {

class CompiledPolicy {
 public:
  CompiledPolicy(torch::jit::Module module, std::string backend, std::string mode);
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& obs);
  at::Tensor forward_exploration(const at::Tensor& obs);
  std::string name() const { return backend_ + "/" + mode_; }

 private:
  torch::jit::Module module_;
  const std::string backend_, mode_;
};

// Every (backend, mode) pair compile() accepts.
std::vector<std::pair<std::string, std::string>> compile_backends();

CompiledPolicy compile_policy(PpoPolicy policy, const std::string& backend,
                              const std::string& mode = "default");

// The backend/mode to use by default for a model at a batch size: XNNPACK
// for the MLP, freeze + optimize_for_inference for the CNN (XNNPACK's
// convolutions lose to oneDNN's at larger batches).
std::pair<std::string, std::string> default_backend(PolicyKind kind);

// Intra-op threads for libtorch (OpenMP) and XNNPACK's pool together.
void set_policy_threads(int threads);
constexpr int kDefaultPolicyThreads = 1;

}  // namespace ddprpc::models
