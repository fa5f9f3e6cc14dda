#include "models/ppo_policy.h"

#include <ATen/Context.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace ddprpc::models {
namespace {

int64_t parameter_count(PpoPolicy& policy) {
  int64_t n = 0;
  for (const auto& p : policy->parameters()) n += p.numel();
  return n;
}

TEST(PpoPolicyTest, MlpHasRllibDefaultShapes) {
  PpoPolicy policy = make_mlp_policy();
  // fcnet_hiddens [256, 256] on 4 observations, logits for 2 actions, 1 value.
  EXPECT_EQ(parameter_count(policy), (4 * 256 + 256) + (256 * 256 + 256) + (256 * 2 + 2) + (256 + 1));
  c10::InferenceMode guard;
  PolicyOutput out = policy->forward_exploration(policy->example_input(5));
  EXPECT_EQ(out.logits.sizes(), (std::vector<int64_t>{5, 2}));
  EXPECT_EQ(out.value.sizes(), (std::vector<int64_t>{5, 1}));
  EXPECT_EQ(out.actions.sizes(), (std::vector<int64_t>{5}));
  EXPECT_EQ(out.actions.scalar_type(), at::kLong);
}

TEST(PpoPolicyTest, CnnEncodesAtariFramesTo256Features) {
  PpoPolicy policy = make_cnn_policy();
  // [[16, [8, 8], 4], [32, [4, 4], 2], [256, [11, 11], 1]] on 4 stacked frames.
  EXPECT_EQ(parameter_count(policy), (4 * 16 * 8 * 8 + 16) + (16 * 32 * 4 * 4 + 32) +
                                         (32 * 256 * 11 * 11 + 256) + (256 * 6 + 6) + (256 + 1));
  c10::InferenceMode guard;
  at::Tensor obs = policy->example_input(3);
  EXPECT_EQ(obs.sizes(), (std::vector<int64_t>{3, 4, 84, 84}));
  at::Tensor h = policy->conv2->forward(policy->conv1->forward(obs));
  EXPECT_EQ(h.sizes(), (std::vector<int64_t>{3, 32, 11, 11}));
  PolicyOutput out = policy->forward_exploration(obs);
  EXPECT_EQ(out.logits.sizes(), (std::vector<int64_t>{3, 6}));
  EXPECT_EQ(out.value.sizes(), (std::vector<int64_t>{3, 1}));
  EXPECT_TRUE(out.actions.ge(0).all().item<bool>() && out.actions.lt(6).all().item<bool>());
}

TEST(PpoPolicyTest, SamplingFollowsTheLogits) {
  at::manual_seed(0);
  at::Tensor logits = at::zeros({4000, 2});
  logits.select(1, 1).fill_(std::log(3.0));  // p(action 1) = 0.75
  double ones = sample_actions(logits).to(at::kFloat).mean().item<double>();
  EXPECT_NEAR(ones, 0.75, 0.03);  // 4.4 standard deviations
}

}  // namespace
}  // namespace ddprpc::models
