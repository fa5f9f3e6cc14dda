// Turns a PpoPolicy into a faster inference module: a TorchScript module
// holding a snapshot of the policy's weights whose forward_exploration is
// encoder + heads + Gumbel-max sample in one graph. Selected as backend +
// mode, like torch.compile's backend/mode in the seed:
//
//   backend      mode      what it does
//   torchscript  script    the policy as a TorchScript module
//                freeze    + torch::jit::freeze (weights become constants)
//                optimize  + freeze + optimize_for_inference (oneDNN paths:
//                          prepacked convolutions and linears)
//   xnnpack      default   optimizeForMobile: prepacked XNNPACK linear/conv
//                          with fused clamps, as optimize_for_mobile does
//   nnc          default   freeze + the TensorExpr (NNC) fuser with LLVM
//                          codegen; fails where libtorch has no LLVM
//                          (Debian's 1.13 has none)
//                interp    the same with NNC's IR interpreter instead of LLVM
//
// A compiled policy gives eager's logits and values up to float rounding and,
// from the same generator state, the same actions. A backend/mode that
// cannot handle a policy makes compile_policy throw std::runtime_error naming
// both (compile_policy runs the module until its graph is optimized, so
// failures surface there, not in the first real call).
//
// Threads. libtorch has two intra-op pools, both sized by at::set_num_threads:
// OpenMP's (ATen kernels, oneDNN) and XNNPACK's pthreadpool, and the idle
// workers of both spin before they sleep. A call that alternates between them
// (XNNPACK linears and tanh, whose kernel goes parallel above 2048 elements:
// batch >= 9 on the MLP) keeps one more spinning thread than a 2-core machine
// has cores, so each hand-off waits for a scheduler tick: the MLP at batch 16
// on 2 threads fell from thousands to tens of calls/s. Threads::kCallerThread
// (the default) runs every op of a call on the calling thread (an OpenMP team
// of one, no XNNPACK pool), whatever at::set_num_threads says: immune to
// that, and the fastest choice for small batches on small machines.
// Threads::kIntraOpPools uses the pools as configured; run such processes
// with OMP_WAIT_POLICY=PASSIVE.
//
// Calls run under c10::InferenceMode (outputs are inference tensors). nnc
// policies switch process-wide JIT fuser settings around each call: do not
// call them concurrently with other TorchScript code. Other backends take
// concurrent calls: an xnnpack module's prepacked linears hold per-call
// state, so each concurrent caller runs its own instance (the first call
// that finds every instance busy compiles another: one per concurrent
// caller at most, each holding a copy of the weights).
#pragma once

#include <torch/script.h>

#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "models/ppo_policy.h"

namespace ddprpc::models {

enum class Threads { kCallerThread, kIntraOpPools };

// A compiled module's instances and settings (policy_compile.cc).
class CompiledModule;

struct CompileOptions {
  std::string backend;  // empty: default_backend(policy kind), with its mode
  std::string mode;     // empty: the backend's first mode in compile_backends()
  Threads threads = Threads::kCallerThread;
};

class CompiledPolicy {
 public:
  // (logits [B, actions], value [B, 1])
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& obs);
  PolicyOutput forward_exploration(const at::Tensor& obs);

  const std::string& backend() const;
  const std::string& mode() const;
  std::string name() const { return backend() + "/" + mode(); }
  Threads threads() const;

 private:
  friend CompiledPolicy compile_policy(const PpoPolicy& policy, const CompileOptions& options);
  explicit CompiledPolicy(std::shared_ptr<CompiledModule> module);

  std::shared_ptr<CompiledModule> module_;  // shared by copies
};

// rpc_rl's agent policy, compiled the same way: linear layers (weight
// [out, in] and bias [out] each, applied in order with nothing between
// them) and a softmax over the last dimension. Holds copies of the weights.
class CompiledLinearSoftmax {
 public:
  // x [B, in] -> probabilities [B, out].
  at::Tensor forward(const at::Tensor& x);
  std::string name() const;

 private:
  friend CompiledLinearSoftmax compile_linear_softmax(
      const std::vector<std::pair<at::Tensor, at::Tensor>>& layers, const CompileOptions& options);
  explicit CompiledLinearSoftmax(std::shared_ptr<CompiledModule> module);

  std::shared_ptr<CompiledModule> module_;  // shared by copies
};

// Every (backend, mode) pair compile_policy knows, in the order above.
std::vector<std::pair<std::string, std::string>> compile_backends();

// "BACKEND" or "BACKEND/MODE" into options' backend and mode (an empty mode:
// the backend's first); false with *error for a pair not in compile_backends().
bool parse_compile_spec(const std::string& spec, CompileOptions* options, std::string* error);

CompiledPolicy compile_policy(const PpoPolicy& policy, const CompileOptions& options = {});
CompiledPolicy compile_policy(const PpoPolicy& policy, const std::string& backend,
                              const std::string& mode);

// With no backend given: the MLP's default (default_backend). Throws
// std::runtime_error as compile_policy does.
CompiledLinearSoftmax compile_linear_softmax(
    const std::vector<std::pair<at::Tensor, at::Tensor>>& layers, const CompileOptions& options);

// The default backend/mode for a policy kind: xnnpack/default for the MLP
// where libtorch has XNNPACK, torchscript/optimize otherwise and for the
// CNN (XNNPACK's convolutions lose to oneDNN's at larger batches).
// Compiling with xnnpack on a libtorch without it (PyTorch's x86 wheels of
// 2.x) throws, naming the backend and the model.
std::pair<std::string, std::string> default_backend(PolicyKind kind);

}  // namespace ddprpc::models
