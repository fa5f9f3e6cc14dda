#include "models/policy_compile.h"

#include <ATen/Parallel.h>
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/csrc/jit/passes/xnnpack_rewrite.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace ddprpc::models {
namespace {

constexpr char kMlpSource[] = R"(
def forward(self, obs: Tensor) -> Tuple[Tensor, Tensor]:
    h = torch.tanh(torch.linear(obs, self.fc1_weight, self.fc1_bias))
    h = torch.tanh(torch.linear(h, self.fc2_weight, self.fc2_bias))
    return torch.linear(h, self.pi_weight, self.pi_bias), torch.linear(h, self.vf_weight, self.vf_bias)
)";

constexpr char kCnnSource[] = R"(
def forward(self, obs: Tensor) -> Tuple[Tensor, Tensor]:
    h = torch.relu(torch.conv2d(obs, self.conv1_weight, self.conv1_bias, [4, 4], [2, 2], [1, 1], 1))
    h = torch.relu(torch.conv2d(h, self.conv2_weight, self.conv2_bias, [2, 2], [2, 2], [1, 1], 1))
    h = torch.relu(torch.conv2d(h, self.conv3_weight, self.conv3_bias, [1, 1], [0, 0], [1, 1], 1))
    h = torch.flatten(h, 1)
    return torch.linear(h, self.pi_weight, self.pi_bias), torch.linear(h, self.vf_weight, self.vf_bias)
)";

// The policy as a TorchScript module sharing its parameters' values.
torch::jit::Module script(PpoPolicy& policy) {
  torch::jit::Module m(absl::StrCat("ddprpc.PpoPolicy_", kind_name(policy->kind)));
  for (const auto& item : policy->named_parameters()) {
    m.register_parameter(absl::StrReplaceAll(item.key(), {{".", "_"}}), item.value().detach().clone(),
                         /*is_buffer=*/false);
  }
  m.define(policy->kind == PolicyKind::kMlp ? kMlpSource : kCnnSource);
  m.eval();
  return m;
}

}  // namespace

CompiledPolicy::CompiledPolicy(torch::jit::Module module, std::string backend, std::string mode)
    : module_(std::move(module)), backend_(std::move(backend)), mode_(std::move(mode)) {}

std::tuple<at::Tensor, at::Tensor> CompiledPolicy::forward(const at::Tensor& obs) {
  c10::InferenceMode guard;
  auto out = module_.forward({obs}).toTuple();
  return {out->elements()[0].toTensor(), out->elements()[1].toTensor()};
}

at::Tensor CompiledPolicy::forward_exploration(const at::Tensor& obs) {
  return sample_actions(std::get<0>(forward(obs)));
}

std::vector<std::pair<std::string, std::string>> compile_backends() {
  return {{"torchscript", "script"},
          {"torchscript", "freeze"},
          {"torchscript", "optimize"},
          {"xnnpack", "default"},
          {"nnc", "default"}};
}

CompiledPolicy compile_policy(PpoPolicy policy, const std::string& backend, const std::string& mode) {
  const std::string what = absl::StrCat("backend '", backend, "' (mode '", mode, "') on the ",
                                        kind_name(policy->kind), " policy");
  try {
    torch::jit::Module m = script(policy);
    if (backend == "torchscript") {
      if (mode == "freeze") {
        m = torch::jit::freeze(m);
      } else if (mode == "optimize") {
        m = torch::jit::freeze(m);
        m = torch::jit::optimize_for_inference(m);
      } else if (mode != "script") {
        throw std::invalid_argument("unknown mode (use script, freeze or optimize)");
      }
    } else if (backend == "xnnpack") {
      if (mode != "default") throw std::invalid_argument("unknown mode (use default)");
      m = torch::jit::optimizeForMobile(torch::jit::freeze(m));
    } else if (backend == "nnc") {
      if (mode != "default") throw std::invalid_argument("unknown mode (use default)");
      torch::jit::setTensorExprFuserEnabled(true);
    } else {
      throw std::invalid_argument("unknown backend (use torchscript, xnnpack or nnc)");
    }
    CompiledPolicy compiled(std::move(m), backend, mode);
    // Run once: some backends only fail (or specialize) on first use.
    compiled.forward(policy->example_input(1));
    return compiled;
  } catch (const std::exception& e) {
    throw std::runtime_error(what + " failed: " + e.what());
  }
}

std::pair<std::string, std::string> default_backend(PolicyKind kind) {
  if (kind == PolicyKind::kMlp) return {"xnnpack", "default"};
  return {"torchscript", "optimize"};
}

void set_policy_threads(int threads) { at::set_num_threads(threads); }

}  // namespace ddprpc::models
