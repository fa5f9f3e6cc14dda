#include "models/linear.h"
#include "models/policy_compile.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/softmax.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>

#include <atomic>
#include <exception>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "gtest/gtest.h"

namespace ddprpc::models {
namespace {

using Backend = std::pair<std::string, std::string>;

PpoPolicy make_policy(PolicyKind kind) {
  PpoPolicy policy = kind == PolicyKind::kMlp ? make_mlp_policy() : make_cnn_policy();
  policy->eval();
  return policy;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

float max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<float>(); }

// Same logits, values and (from the same generator state) actions as eager.
void expect_same_as_eager(PpoPolicy& policy, CompiledPolicy& compiled) {
  c10::InferenceMode guard;
  for (int64_t batch : {1, 4, 16}) {
    SCOPED_TRACE(compiled.name() + " batch " + std::to_string(batch));
    at::Tensor obs = policy->example_input(batch);
    auto [logits, value] = policy->forward(obs);
    auto [c_logits, c_value] = compiled.forward(obs);
    EXPECT_TRUE(at::allclose(logits, c_logits, 1e-5, 1e-5)) << "max diff " << max_diff(logits, c_logits);
    EXPECT_TRUE(at::allclose(value, c_value, 1e-5, 1e-5)) << "max diff " << max_diff(value, c_value);

    at::manual_seed(batch);
    PolicyOutput eager = policy->forward_exploration(obs);
    at::manual_seed(batch);
    PolicyOutput out = compiled.forward_exploration(obs);
    EXPECT_TRUE(at::allclose(eager.logits, out.logits, 1e-5, 1e-5)) << max_diff(eager.logits, out.logits);
    EXPECT_TRUE(at::allclose(eager.value, out.value, 1e-5, 1e-5)) << max_diff(eager.value, out.value);
    EXPECT_TRUE(out.actions.equal(eager.actions)) << out.actions << eager.actions;
  }
}

class EveryBackendTest : public testing::TestWithParam<std::tuple<PolicyKind, Backend>> {};

TEST_P(EveryBackendTest, MatchesEagerOrFailsNamingBackendAndModel) {
  const auto& [kind, backend] = GetParam();
  PpoPolicy policy = make_policy(kind);
  if (backend == Backend{"nnc", "default"} ||
      (backend.first == "xnnpack" && !xnnpack_linear_available())) {
    // NNC's LLVM codegen and XNNPACK depend on how libtorch was built.
    try {
      CompiledPolicy compiled = compile_policy(policy, backend.first, backend.second);
      expect_same_as_eager(policy, compiled);
    } catch (const std::runtime_error& e) {
      EXPECT_TRUE(contains(e.what(), "backend '" + backend.first + "' (mode '" + backend.second + "')"))
          << e.what();
      EXPECT_TRUE(contains(e.what(), kind_name(kind) + " policy")) << e.what();
    }
    return;
  }
  CompiledPolicy compiled = compile_policy(policy, backend.first, backend.second);
  EXPECT_EQ(compiled.name(), backend.first + "/" + backend.second);
  expect_same_as_eager(policy, compiled);
}

INSTANTIATE_TEST_SUITE_P(
    PolicyCompile, EveryBackendTest,
    testing::Combine(testing::Values(PolicyKind::kMlp, PolicyKind::kCnn), testing::ValuesIn(compile_backends())),
    [](const testing::TestParamInfo<EveryBackendTest::ParamType>& info) {
      const Backend& backend = std::get<1>(info.param);
      return kind_name(std::get<0>(info.param)) + "_" + backend.first + "_" + backend.second;
    });

TEST(PolicyCompileTest, DefaultOptionsPickTheDefaultBackend) {
  for (PolicyKind kind : {PolicyKind::kMlp, PolicyKind::kCnn}) {
    PpoPolicy policy = make_policy(kind);
    CompiledPolicy compiled = compile_policy(policy);
    auto [backend, mode] = default_backend(kind);
    EXPECT_EQ(compiled.backend(), backend);
    EXPECT_EQ(compiled.mode(), mode);
    EXPECT_EQ(compiled.threads(), Threads::kCallerThread);
  }
}

TEST(PolicyCompileTest, UnknownBackendNamesBackendAndModel) {
  try {
    compile_policy(make_policy(PolicyKind::kCnn), "tensorrt", "max-autotune");
    FAIL() << "compiled with an unknown backend";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), "backend 'tensorrt' (mode 'max-autotune')")) << e.what();
    EXPECT_TRUE(contains(e.what(), "cnn policy")) << e.what();
  }
  try {
    compile_policy(make_policy(PolicyKind::kMlp), "xnnpack", "max-autotune");
    FAIL() << "compiled with an unknown mode";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), "mlp policy")) << e.what();
    EXPECT_TRUE(contains(e.what(), "xnnpack/default")) << e.what();  // lists what is known
  }
}

TEST(PolicyCompileTest, ThreadChoicesGiveTheSameResultsAndRestoreSettings) {
  const int threads_before = at::get_num_threads();
  at::set_num_threads(2);
  PpoPolicy policy = make_policy(PolicyKind::kMlp);
  CompileOptions options;
  options.backend = default_backend(PolicyKind::kMlp).first;
  CompiledPolicy caller = compile_policy(policy, options);
  options.threads = Threads::kIntraOpPools;
  CompiledPolicy pools = compile_policy(policy, options);
  at::Tensor obs = policy->example_input(16);  // tanh goes parallel at this size
  auto [a, a_value] = caller.forward(obs);
  EXPECT_EQ(at::get_num_threads(), 2);  // the caller-thread guard put it back
  auto [b, b_value] = pools.forward(obs);
  EXPECT_TRUE(at::allclose(a, b, 1e-5, 1e-5)) << max_diff(a, b);
  EXPECT_TRUE(at::allclose(a_value, b_value, 1e-5, 1e-5));
  at::set_num_threads(threads_before);
}

TEST(PolicyCompileTest, NncLeavesTheProcessFuserSettingAlone) {
  const bool before = torch::jit::tensorExprFuserEnabled();
  PpoPolicy policy = make_policy(PolicyKind::kMlp);
  CompiledPolicy compiled = compile_policy(policy, "nnc", "interp");
  compiled.forward_exploration(policy->example_input(3));
  EXPECT_EQ(torch::jit::tensorExprFuserEnabled(), before);
}

// rpc_rl's policy (linears, then softmax) on every backend that works here
// gives eager's probabilities; nnc/default needs LLVM and may fail, naming it.
TEST(PolicyCompileTest, LinearSoftmaxMatchesEagerOnEveryBackend) {
  at::manual_seed(3);
  std::vector<std::pair<at::Tensor, at::Tensor>> layers = {{at::randn({10, 200}), at::randn({10})}};
  for (int i = 0; i < 5; ++i) layers.emplace_back(at::randn({10, 10}) * 0.3, at::randn({10}));
  for (const Backend& backend : compile_backends()) {
    SCOPED_TRACE(backend.first + "/" + backend.second);
    CompileOptions options;
    options.backend = backend.first;
    options.mode = backend.second;
    if (backend == Backend{"nnc", "default"} ||
        (backend.first == "xnnpack" && !xnnpack_linear_available())) {
      try {
        compile_linear_softmax(layers, options);
      } catch (const std::runtime_error& e) {
        EXPECT_TRUE(contains(e.what(), backend.first) && contains(e.what(), "linear + softmax"))
            << e.what();
      }
      continue;
    }
    CompiledLinearSoftmax compiled = compile_linear_softmax(layers, options);
    EXPECT_EQ(compiled.name(), backend.first + "/" + backend.second);
    for (int64_t batch : {1, 8}) {
      at::Tensor x = at::randn({batch, 200});
      at::Tensor h = x;
      for (const auto& [w, b] : layers) h = at::linear(h, w, b);
      at::Tensor eager = at::softmax(h, -1);
      at::Tensor out = compiled.forward(x);
      EXPECT_TRUE(at::allclose(eager, out, 1e-5, 1e-5)) << "max diff " << max_diff(eager, out);
    }
  }
  CompileOptions bogus;
  bogus.backend = "bogus";
  EXPECT_THROW(compile_linear_softmax(layers, bogus), std::runtime_error);
}

// Calls from several threads at once each get their own input's answer, on
// every backend (XNNPACK's prepacked linears are set up per call: threads
// sharing one would race on its operator).
TEST(PolicyCompileTest, ConcurrentCallsEachGetTheirOwnAnswer) {
  at::manual_seed(5);
  std::vector<std::pair<at::Tensor, at::Tensor>> layers = {{at::randn({16, 64}), at::randn({16})}};
  for (int i = 0; i < 2; ++i) layers.emplace_back(at::randn({16, 16}) * 0.3, at::randn({16}));
  constexpr int kThreads = 4, kCalls = 5000;
  std::vector<at::Tensor> inputs, expected;
  for (int t = 0; t < kThreads; ++t) {
    // Each thread its own batch size, so a call set up by another thread
    // would also have the wrong shape.
    at::Tensor x = at::randn({t + 1, 64});
    at::Tensor h = x;
    for (const auto& [w, b] : layers) h = at::linear(h, w, b);
    inputs.push_back(x);
    expected.push_back(at::softmax(h, -1));
  }
  for (const Backend& backend : compile_backends()) {
    if (backend.first == "nnc") continue;  // process-wide fuser settings: not for concurrent calls
    if (backend.first == "xnnpack" && !xnnpack_linear_available()) continue;  // not in this libtorch
    SCOPED_TRACE(backend.first + "/" + backend.second);
    CompileOptions options;
    options.backend = backend.first;
    options.mode = backend.second;
    CompiledLinearSoftmax compiled = compile_linear_softmax(layers, options);
    std::atomic<int> wrong{0}, failed{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kCalls; ++i) {
          try {
            at::Tensor out = compiled.forward(inputs[t]);
            if (!at::allclose(out, expected[t], 1e-5, 1e-5)) ++wrong;
          } catch (const std::exception&) {
            ++failed;
          }
        }
      });
    }
    for (auto& thread : threads) thread.join();
    EXPECT_EQ(wrong.load(), 0);
    EXPECT_EQ(failed.load(), 0);
  }
}

}  // namespace
}  // namespace ddprpc::models
