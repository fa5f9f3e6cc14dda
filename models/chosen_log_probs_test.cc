#include "models/chosen_log_probs.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/log.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <stdexcept>
#include <vector>

#include "gtest/gtest.h"

namespace ddprpc::models {
namespace {

// What Categorical(probs).log_prob(actions) computes, op by op.
at::Tensor by_ops(const at::Tensor& probs, const std::vector<int64_t>& actions) {
  return probs.gather(1, at::tensor(actions, at::kLong).view({-1, 1})).log().view({-1});
}

TEST(ChosenLogProbsTest, ValuesAndGradientsAreThoseOfGatherAndLog) {
  const at::Tensor logits = at::randn({5, 7}).requires_grad_();
  const at::Tensor probs = at::softmax(logits, -1);
  const std::vector<int64_t> actions{0, 6, 3, 3, 1};
  const at::Tensor fused = chosen_log_probs(probs, actions);
  const at::Tensor reference = by_ops(probs, actions);
  ASSERT_EQ(fused.sizes(), reference.sizes());
  EXPECT_TRUE(at::allclose(fused, reference, 1e-6, 1e-7));
  // One node, whose only input is probs (the softmax).
  ASSERT_NE(fused.grad_fn(), nullptr);
  ASSERT_EQ(fused.grad_fn()->next_edges().size(), 1u);
  EXPECT_EQ(fused.grad_fn()->next_edges()[0].function, probs.grad_fn());

  const at::Tensor weight = at::randn({5});
  const auto got = torch::autograd::grad({(fused * weight).sum()}, {logits}, {},
                                         /*retain_graph=*/true);
  const auto want = torch::autograd::grad({(reference * weight).sum()}, {logits});
  EXPECT_TRUE(at::allclose(got[0], want[0], 1e-5, 1e-7));
  // And with respect to probs itself: g / p at the chosen entries only.
  const at::Tensor leaf = at::rand({2, 3}).add_(0.1).requires_grad_();
  const auto d = torch::autograd::grad({chosen_log_probs(leaf, {2, 0}).sum()}, {leaf})[0];
  const at::Tensor p = leaf.detach();
  const std::vector<float> expected{0, 0, 1 / p[0][2].item<float>(), 1 / p[1][0].item<float>(), 0,
                                    0};
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(d.view({-1})[i].item<float>(), expected[i]) << i;
}

TEST(ChosenLogProbsTest, OtherTensorsGoThroughATen) {
  const at::Tensor probs = at::rand({3, 4}, at::kDouble).add_(0.1);
  const std::vector<int64_t> actions{1, 2, 3};
  const at::Tensor got = chosen_log_probs(probs, actions);
  EXPECT_EQ(got.scalar_type(), at::kDouble);
  EXPECT_TRUE(at::allclose(got, by_ops(probs, actions)));
  const at::Tensor strided = at::rand({4, 3}).add_(0.1).t();  // not contiguous
  EXPECT_TRUE(at::allclose(chosen_log_probs(strided, actions), by_ops(strided, actions)));
}

TEST(ChosenLogProbsTest, BadShapesAndActionsAreRejected) {
  const at::Tensor probs = at::rand({2, 3});
  EXPECT_THROW(chosen_log_probs(probs, {0}), std::invalid_argument);
  EXPECT_THROW(chosen_log_probs(probs, {0, 3}), std::invalid_argument);
  EXPECT_THROW(chosen_log_probs(probs, {-1, 0}), std::invalid_argument);
  EXPECT_THROW(chosen_log_probs(at::rand({6}), {0, 1}), std::invalid_argument);
}

}  // namespace
}  // namespace ddprpc::models
