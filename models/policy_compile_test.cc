#include "models/policy_compile.h"

#include <ATen/ops/allclose.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <ATen/TensorOperators.h>

#include "gtest/gtest.h"

namespace ddprpc::models {
namespace {

void expect_same_as_eager(PpoPolicy policy) {
  for (const auto& [backend, mode] : compile_backends()) {
    CompiledPolicy compiled = compile_policy(policy, backend, mode);
    for (int64_t batch : {1, 4, 16}) {
      at::Tensor obs = policy->example_input(batch);
      auto [logits, value] = policy->forward(obs);
      auto [c_logits, c_value] = compiled.forward(obs);
      EXPECT_TRUE(at::allclose(logits, c_logits, 1e-5, 1e-5))
          << compiled.name() << " batch " << batch << " max diff "
          << (logits - c_logits).abs().max().item<float>();
      EXPECT_TRUE(at::allclose(value, c_value, 1e-5, 1e-5)) << compiled.name() << " batch " << batch;
      at::Tensor actions = compiled.forward_exploration(obs);
      EXPECT_EQ(actions.size(0), batch);
      EXPECT_TRUE(actions.ge(0).all().item<bool>() && actions.lt(policy->actions).all().item<bool>());
    }
  }
}

TEST(PolicyCompileTest, MlpCompiledMatchesEager) { expect_same_as_eager(make_mlp_policy()); }

TEST(PolicyCompileTest, CnnCompiledMatchesEager) { expect_same_as_eager(make_cnn_policy()); }

TEST(PolicyCompileTest, UnknownBackendNamesBackendAndModel) {
  try {
    compile_policy(make_cnn_policy(), "tensorrt", "max-autotune");
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("tensorrt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cnn policy"), std::string::npos) << e.what();
  }
}

TEST(PolicyCompileTest, SamplingFollowsTheLogits) {
  at::Tensor logits = at::zeros({1000, 2});
  logits.select(1, 1).fill_(5.0);  // p(action 1) = 0.993
  double ones = sample_actions(logits).to(at::kFloat).mean().item<double>();
  EXPECT_GT(ones, 0.97);
  EXPECT_LT(ones, 1.0);
}

}  // namespace
}  // namespace ddprpc::models
