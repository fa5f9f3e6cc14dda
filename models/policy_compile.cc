#include "models/linear.h"
#include "models/policy_compile.h"

#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <omp.h>
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/csrc/jit/passes/xnnpack_rewrite.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/tensorexpr/kernel.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <stdexcept>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"

// Exported by libtorch_cpu, declared in headers Debian does not ship
// (caffe2/utils/threadpool/thread_pool_guard.h,
// torch/csrc/jit/codegen/fuser/interface.h).
namespace caffe2 {
struct TORCH_API _NoPThreadPoolGuard {
  // Thread-local: while enabled, caffe2::pthreadpool_() is null and XNNPACK
  // runs its work on the calling thread.
  static bool is_enabled();
  static void set_enabled(bool enabled);
};
}  // namespace caffe2
namespace torch::jit {
TORCH_API bool canFuseOnCPU();
TORCH_API void overrideCanFuseOnCPU(bool value);
}  // namespace torch::jit

namespace ddprpc::models {
namespace {

// The encoder of each kind; leaves the features in `h`.
constexpr char kMlpEncoder[] = R"(
    h = torch.tanh(torch.linear(obs, self.fc1_weight, self.fc1_bias))
    h = torch.tanh(torch.linear(h, self.fc2_weight, self.fc2_bias))
)";

constexpr char kCnnEncoder[] = R"(
    h = torch.relu(torch.conv2d(obs, self.conv1_weight, self.conv1_bias, [4, 4], [2, 2], [1, 1], 1))
    h = torch.relu(torch.conv2d(h, self.conv2_weight, self.conv2_bias, [2, 2], [2, 2], [1, 1], 1))
    h = torch.relu(torch.conv2d(h, self.conv3_weight, self.conv3_bias, [1, 1], [0, 0], [1, 1], 1))
    h = torch.flatten(h, 1)
)";

// The sample is sample_actions() (ppo_policy.cc) step for step, so the same
// generator state gives the same actions.
std::string policy_source(PolicyKind kind) {
  const char* encoder = kind == PolicyKind::kMlp ? kMlpEncoder : kCnnEncoder;
  return absl::StrCat(
      "def forward(self, obs: Tensor) -> Tuple[Tensor, Tensor]:", encoder,
      "    return torch.linear(h, self.pi_weight, self.pi_bias), "
      "torch.linear(h, self.vf_weight, self.vf_bias)\n\n"
      "def forward_exploration(self, obs: Tensor) -> Tuple[Tensor, Tensor, Tensor]:",
      encoder,
      "    logits = torch.linear(h, self.pi_weight, self.pi_bias)\n"
      "    value = torch.linear(h, self.vf_weight, self.vf_bias)\n"
      "    u = torch.rand_like(logits).clamp(1e-10, 1.0)\n"
      "    return torch.argmax(logits - torch.log(-torch.log(u)), 1), logits, value\n");
}

// The policy as a TorchScript module holding a copy of its weights.
torch::jit::Module script(const PpoPolicy& policy) {
  torch::jit::Module m(absl::StrCat("ddprpc.PpoPolicy_", kind_name(policy->kind)));
  for (const auto& item : policy->named_parameters()) {
    m.register_parameter(absl::StrReplaceAll(item.key(), {{".", "_"}}), item.value().detach().clone(),
                         /*is_buffer=*/false);
  }
  m.define(policy_source(policy->kind));
  m.eval();
  return m;
}

// Every op of a call on the calling thread: an OpenMP team of one (ATen's
// parallel_for and oneDNN read this thread's omp_get_max_threads) and no
// XNNPACK pool.
class CallerThreadGuard {
 public:
  CallerThreadGuard()
      : omp_threads_(at::get_num_threads()),  // also initializes ATen's threads on this thread
        no_pool_(caffe2::_NoPThreadPoolGuard::is_enabled()) {
    if (omp_threads_ != 1) omp_set_num_threads(1);
    caffe2::_NoPThreadPoolGuard::set_enabled(true);
  }
  ~CallerThreadGuard() {
    if (omp_threads_ != 1) omp_set_num_threads(omp_threads_);
    caffe2::_NoPThreadPoolGuard::set_enabled(no_pool_);
  }
  CallerThreadGuard(const CallerThreadGuard&) = delete;
  CallerThreadGuard& operator=(const CallerThreadGuard&) = delete;

 private:
  const int omp_threads_;
  const bool no_pool_;
};

// The TensorExpr fuser on for CPU tensors (LLVM codegen, or NNC's IR
// interpreter). These are process-wide JIT settings: the graph executor
// reads them when it (re)optimizes a graph, which can happen on any call
// (a new batch size), so they are set around every call of an nnc policy.
class FuserGuard {
 public:
  explicit FuserGuard(bool interpreter)
      : enabled_(torch::jit::tensorExprFuserEnabled()),
        cpu_(torch::jit::canFuseOnCPU()),
        llvm_(torch::jit::tensorexpr::getTEMustUseLLVMOnCPU()) {
    torch::jit::setTensorExprFuserEnabled(true);
    torch::jit::overrideCanFuseOnCPU(true);
    torch::jit::tensorexpr::getTEMustUseLLVMOnCPU() = !interpreter;
  }
  ~FuserGuard() {
    torch::jit::setTensorExprFuserEnabled(enabled_);
    torch::jit::overrideCanFuseOnCPU(cpu_);
    torch::jit::tensorexpr::getTEMustUseLLVMOnCPU() = llvm_;
  }
  FuserGuard(const FuserGuard&) = delete;
  FuserGuard& operator=(const FuserGuard&) = delete;

 private:
  const bool enabled_, cpu_, llvm_;
};

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// Runs `method` of a compiled module on x under its thread and fuser settings.
c10::IValue run_compiled(const torch::jit::Module& module, const std::string& backend,
                         const std::string& mode, Threads threads, const char* method,
                         const at::Tensor& x) {
  c10::InferenceMode inference;
  std::optional<CallerThreadGuard> caller_thread;
  if (threads == Threads::kCallerThread) caller_thread.emplace();
  std::optional<FuserGuard> fuser;
  if (backend == "nnc") fuser.emplace(/*interpreter=*/mode == "interp");
  return module.get_method(method)({x});
}

// options' backend and mode, the defaults filled in; throws for an unknown pair.
std::pair<std::string, std::string> resolve(const CompileOptions& options,
                                            const std::pair<std::string, std::string>& fallback,
                                            const std::string& what_model) {
  const auto known = compile_backends();
  std::string backend = options.backend, mode = options.mode;
  if (backend.empty()) {
    backend = fallback.first;
    if (mode.empty()) mode = fallback.second;
  }
  if (mode.empty()) {
    mode = "default";
    for (const auto& [b, m] : known) {
      if (b == backend) {
        mode = m;
        break;
      }
    }
  }
  if (std::find(known.begin(), known.end(), std::make_pair(backend, mode)) == known.end()) {
    throw std::runtime_error(absl::StrCat(
        "backend '", backend, "' (mode '", mode, "') on the ", what_model,
        ": unknown backend/mode; known: ",
        absl::StrJoin(known, ", ", [](std::string* out, const auto& p) { absl::StrAppend(out, p.first, "/", p.second); })));
  }
  return {backend, mode};
}

// The backend's passes over a scripted module.
torch::jit::Module optimize(torch::jit::Module m, const std::string& backend,
                            const std::string& mode, const std::vector<std::string>& other_methods) {
  if (backend == "torchscript" && mode == "freeze") {
    m = torch::jit::freeze(m, other_methods);
  } else if (backend == "torchscript" && mode == "optimize") {
    m = torch::jit::freeze(m, other_methods);
    m = torch::jit::optimize_for_inference(m, other_methods);
  } else if (backend == "xnnpack") {
    // optimizeForMobile asserts inside libtorch when it has no XNNPACK.
    if (!xnnpack_linear_available()) {
      throw std::runtime_error(
          "this libtorch was built without XNNPACK (PyTorch's x86 wheels of 2.x are)");
    }
    m = torch::jit::optimizeForMobile(m, /*optimization_blocklist=*/{}, other_methods);
  } else if (backend == "nnc") {
    m = torch::jit::freeze(m, other_methods);
  }
  return m;
}

// What a failed compilation says: the first line of the error, and why
// LLVM is missing when it is.
std::string compile_error(const std::string& what, std::string error) {
  if (error.find("LLVM") != std::string::npos) {
    absl::StrAppend(&error, " (this libtorch was built without LLVM; mode 'interp' uses NNC's IR interpreter)");
  }
  return absl::StrCat(what, " failed: ", error);
}

// Runs `build` (script, optimize, warm up); a failure becomes
// std::runtime_error "<what> failed: <its first line>".
template <typename Build>
auto compile_or_throw(const std::string& what, Build build) -> decltype(build()) {
  std::string error;
  try {
    return build();
  } catch (const c10::Error& e) {
    error = first_line(e.what_without_backtrace());
  } catch (const std::exception& e) {
    error = first_line(e.what());
  }
  throw std::runtime_error(compile_error(what, error));
}

// The profiling executor optimizes (and fuses) a graph after
// getNumProfiledRuns() runs per input shape: run(batch) past that for two
// shapes so that a backend that fails, fails at compile time.
template <typename Run>
void warm_up(Run run) {
  const size_t runs = torch::jit::getNumProfiledRuns() + 2;
  for (int64_t batch : {1, 2}) {
    for (size_t i = 0; i < runs; ++i) run(batch);
  }
}

}  // namespace

// The instances of one compiled module. XNNPACK's prepacked linear (what
// optimizeForMobile puts in the graph) sets its operator up for each call's
// input and then runs it, with no lock: two calls on one instance race
// (failed runs, outputs written at another call's shape, heap corruption).
// On that backend a call runs an instance no other call holds, compiling
// another when every one is busy; the other backends' instance is shared.
class CompiledModule {
 public:
  // make_another: null where one instance takes concurrent calls.
  CompiledModule(torch::jit::Module first, std::function<torch::jit::Module()> make_another,
                 std::string backend, std::string mode, Threads threads)
      : backend(std::move(backend)),
        mode(std::move(mode)),
        threads(threads),
        make_another_(std::move(make_another)),
        shared_(make_another_ ? std::nullopt : std::optional<torch::jit::Module>(first)) {
    if (make_another_) idle_.push_back(std::move(first));
  }

  // Runs `method` on x under the module's thread and fuser settings.
  c10::IValue run(const char* method, const at::Tensor& x) {
    if (shared_) return run_compiled(*shared_, backend, mode, threads, method, x);
    torch::jit::Module instance = take();
    absl::Cleanup give_back = [&] {
      absl::MutexLock lock(&mu_);
      idle_.push_back(instance);
    };
    return run_compiled(instance, backend, mode, threads, method, x);
  }

  const std::string backend, mode;
  const Threads threads;

 private:
  torch::jit::Module take() {
    if (std::optional<torch::jit::Module> idle = take_idle()) return *std::move(idle);
    absl::MutexLock lock(&compile_mu_);  // one compilation at a time
    // One may have come back while this call waited for the compiler.
    if (std::optional<torch::jit::Module> idle = take_idle()) return *std::move(idle);
    return make_another_();
  }

  std::optional<torch::jit::Module> take_idle() {
    absl::MutexLock lock(&mu_);
    if (idle_.empty()) return std::nullopt;
    torch::jit::Module instance = std::move(idle_.back());
    idle_.pop_back();
    return instance;
  }

  const std::function<torch::jit::Module()> make_another_;
  const std::optional<torch::jit::Module> shared_;  // set where make_another_ is null

  absl::Mutex compile_mu_;
  absl::Mutex mu_;
  // State below is protected by mu_.
  std::vector<torch::jit::Module> idle_ ABSL_GUARDED_BY(mu_);
};

namespace {

// `scripted` through the backend's passes, as a CompiledModule that makes
// its further instances the same way where the backend needs them.
std::shared_ptr<CompiledModule> compile_module(const torch::jit::Module& scripted,
                                               const std::string& backend, const std::string& mode,
                                               const std::vector<std::string>& other_methods,
                                               Threads threads) {
  std::function<torch::jit::Module()> make_another;
  if (backend == "xnnpack") {
    make_another = [scripted, backend, mode, other_methods] {
      return optimize(scripted.clone(), backend, mode, other_methods);
    };
  }
  return std::make_shared<CompiledModule>(optimize(scripted.clone(), backend, mode, other_methods),
                                          std::move(make_another), backend, mode, threads);
}

}  // namespace

CompiledPolicy::CompiledPolicy(std::shared_ptr<CompiledModule> module) : module_(std::move(module)) {}

const std::string& CompiledPolicy::backend() const { return module_->backend; }
const std::string& CompiledPolicy::mode() const { return module_->mode; }
Threads CompiledPolicy::threads() const { return module_->threads; }

CompiledLinearSoftmax::CompiledLinearSoftmax(std::shared_ptr<CompiledModule> module)
    : module_(std::move(module)) {}

std::string CompiledLinearSoftmax::name() const { return module_->backend + "/" + module_->mode; }

at::Tensor CompiledLinearSoftmax::forward(const at::Tensor& x) {
  return module_->run("forward", x).toTensor();
}

std::tuple<at::Tensor, at::Tensor> CompiledPolicy::forward(const at::Tensor& obs) {
  auto out = module_->run("forward", obs).toTuple();
  return {out->elements()[0].toTensor(), out->elements()[1].toTensor()};
}

PolicyOutput CompiledPolicy::forward_exploration(const at::Tensor& obs) {
  auto out = module_->run("forward_exploration", obs).toTuple();
  return {out->elements()[0].toTensor(), out->elements()[1].toTensor(), out->elements()[2].toTensor()};
}

std::vector<std::pair<std::string, std::string>> compile_backends() {
  return {{"torchscript", "script"}, {"torchscript", "freeze"}, {"torchscript", "optimize"},
          {"xnnpack", "default"},    {"nnc", "default"},        {"nnc", "interp"}};
}

bool parse_compile_spec(const std::string& spec, CompileOptions* options, std::string* error) {
  const size_t slash = spec.find('/');
  const std::string backend = spec.substr(0, slash);
  const std::string mode = slash == std::string::npos ? "" : spec.substr(slash + 1);
  for (const auto& [b, m] : compile_backends()) {
    if (b == backend && (mode.empty() || m == mode)) {
      options->backend = backend;
      options->mode = mode;
      return true;
    }
  }
  *error = "unknown backend/mode '" + spec + "'";
  return false;
}

std::pair<std::string, std::string> default_backend(PolicyKind kind) {
  if (kind == PolicyKind::kMlp && xnnpack_linear_available()) return {"xnnpack", "default"};
  return {"torchscript", "optimize"};
}

CompiledPolicy compile_policy(const PpoPolicy& policy, const std::string& backend,
                              const std::string& mode) {
  CompileOptions options;
  options.backend = backend;
  options.mode = mode;
  return compile_policy(policy, options);
}

CompiledPolicy compile_policy(const PpoPolicy& policy, const CompileOptions& options) {
  const std::string model = absl::StrCat(kind_name(policy->kind), " policy");
  const auto [backend, mode] = resolve(options, default_backend(policy->kind), model);
  const std::string what = absl::StrCat("backend '", backend, "' (mode '", mode, "') on the ", model);
  return compile_or_throw(what, [&] {
    CompiledPolicy compiled(
        compile_module(script(policy), backend, mode, {"forward_exploration"}, options.threads));
    warm_up([&](int64_t batch) {
      at::Tensor obs = policy->example_input(batch);
      compiled.forward(obs);
      compiled.forward_exploration(obs);
    });
    return compiled;
  });
}

CompiledLinearSoftmax compile_linear_softmax(
    const std::vector<std::pair<at::Tensor, at::Tensor>>& layers, const CompileOptions& options) {
  const std::string model = absl::StrCat(layers.size(), "-layer linear + softmax policy");
  const auto [backend, mode] = resolve(options, default_backend(PolicyKind::kMlp), model);
  const std::string what = absl::StrCat("backend '", backend, "' (mode '", mode, "') on the ", model);
  if (layers.empty()) throw std::runtime_error(what + " failed: no layers");
  return compile_or_throw(what, [&] {
    torch::jit::Module m("ddprpc.LinearSoftmax");
    std::string source = "def forward(self, x: Tensor) -> Tensor:\n    h = x\n";
    for (size_t i = 0; i < layers.size(); ++i) {
      m.register_parameter(absl::StrCat("w", i), layers[i].first.detach().clone(), false);
      m.register_parameter(absl::StrCat("b", i), layers[i].second.detach().clone(), false);
      absl::StrAppend(&source, "    h = torch.linear(h, self.w", i, ", self.b", i, ")\n");
    }
    absl::StrAppend(&source, "    return torch.softmax(h, -1)\n");
    m.define(source);
    m.eval();
    CompiledLinearSoftmax compiled(compile_module(m, backend, mode, {}, options.threads));
    warm_up([&](int64_t batch) { compiled.forward(at::zeros({batch, layers[0].first.size(1)})); });
    return compiled;
  });
}

}  // namespace ddprpc::models
