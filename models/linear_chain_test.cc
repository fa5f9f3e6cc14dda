#include "models/linear_chain.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/softmax.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace ddprpc::models {
namespace {

struct Chain {
  std::vector<at::Tensor> weights, biases;
  // Weights of scale 1/sqrt(in), as torch::nn::Linear's: logits stay of
  // order one. (Far larger ones saturate the softmax, and then float
  // rounding in another order of summation moves the small gradients that
  // are left by more than the tolerance.)
  Chain(std::vector<int64_t> sizes, at::ScalarType dtype = at::kFloat) {
    for (size_t l = 0; l + 1 < sizes.size(); ++l) {
      const double scale = 1.0 / std::sqrt(static_cast<double>(sizes[l]));
      weights.push_back((at::randn({sizes[l + 1], sizes[l]}, dtype) * scale).requires_grad_());
      biases.push_back(at::randn({sizes[l + 1]}, dtype).requires_grad_());
    }
  }
  Chain() = default;
  // A copy in `dtype`, without history (leaves that require grad).
  Chain to(at::ScalarType dtype) const {
    Chain out;
    for (size_t l = 0; l < weights.size(); ++l) {
      out.weights.push_back(weights[l].detach().to(dtype).requires_grad_());
      out.biases.push_back(biases[l].detach().to(dtype).requires_grad_());
    }
    return out;
  }
  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> out;
    for (size_t l = 0; l < weights.size(); ++l) {
      out.push_back(weights[l]);
      out.push_back(biases[l]);
    }
    return out;
  }
};

at::Tensor layer_by_layer(const at::Tensor& x, const Chain& c) {
  at::Tensor h = x;
  for (size_t l = 0; l < c.weights.size(); ++l) h = at::linear(h, c.weights[l], c.biases[l]);
  return at::softmax(h, -1);
}

// Probabilities and the gradients of a weighted sum of them, both ways.
void expect_same_as_layer_by_layer(const std::vector<int64_t>& sizes, int64_t batch) {
  SCOPED_TRACE(::testing::Message() << "batch " << batch << ", " << sizes.size() - 1 << " layers");
  Chain c(sizes);
  const at::Tensor x = at::rand({batch, sizes[0]}).requires_grad_();
  ASSERT_TRUE(linear_chain_fits(x, c.weights, c.biases));
  const at::Tensor fused = linear_chain_softmax(x, c.weights, c.biases);
  const at::Tensor reference = layer_by_layer(x, c);
  ASSERT_NE(fused.grad_fn(), nullptr);
  // One node: its inputs are the leaves themselves.
  EXPECT_EQ(fused.grad_fn()->num_inputs(), 1u);
  EXPECT_EQ(fused.grad_fn()->next_edges().size(), 1 + 2 * c.weights.size());

  const at::Tensor weight = at::randn(fused.sizes());
  std::vector<at::Tensor> leaves = c.parameters();
  leaves.insert(leaves.begin(), x);
  const auto got = torch::autograd::grad({(fused * weight).sum()}, leaves);
  const auto want = torch::autograd::grad({(reference * weight).sum()}, leaves);
  // The same graph in double: what float rounding is measured against.
  Chain exact_chain = c.to(at::kDouble);
  const at::Tensor exact_x = x.detach().to(at::kDouble).requires_grad_();
  std::vector<at::Tensor> exact_leaves = exact_chain.parameters();
  exact_leaves.insert(exact_leaves.begin(), exact_x);
  const at::Tensor exact_probs = layer_by_layer(exact_x, exact_chain);
  // Float rounding moved probabilities by up to 6e-7 (ATen's by as much).
  EXPECT_LE((fused.to(at::kDouble) - exact_probs).abs().max().item<double>(), 1e-5);
  const auto exact = torch::autograd::grad(
      {(exact_probs * weight.to(at::kDouble)).sum()}, exact_leaves);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "gradient of input " << i);
    // Float rounding of sums of up to 2000 products, in another order than
    // ATen's: measured up to 1.5e-4 of the gradient's scale in 100 runs
    // (ATen's own float result is held to the same bound; comparing the two
    // floats with each other failed about one run in a hundred). A wrong
    // product is off by the scale itself.
    const double scale = exact[i].abs().max().item<double>();
    EXPECT_LE((got[i].to(at::kDouble) - exact[i]).abs().max().item<double>(), 1e-3 * scale);
    EXPECT_LE((want[i].to(at::kDouble) - exact[i]).abs().max().item<double>(), 1e-3 * scale);
  }
}

TEST(LinearChainTest, MatchesLayerByLayerLinearsAndSoftmax) {
  // The RPC RL benchmark's policy (state 10x20x10, 10 actions, 5 hidden
  // layers), at one state and at a batch of them.
  const std::vector<int64_t> policy{2000, 10, 10, 10, 10, 10, 10};
  expect_same_as_layer_by_layer(policy, 1);
  expect_same_as_layer_by_layer(policy, 18);
  // Widths that are not multiples of the eight partial sums; one layer.
  expect_same_as_layer_by_layer({13, 7, 5}, 3);
  expect_same_as_layer_by_layer({9, 3}, 2);
  // Blocks of two rows by four outputs with a tail, and an odd last row.
  expect_same_as_layer_by_layer({37, 8, 4}, 5);
}

TEST(LinearChainTest, OnlyTheGradientsAskedForAreComputed) {
  Chain c({6, 4, 3});
  c.weights[0] = c.weights[0].detach();  // a frozen first layer
  const at::Tensor x = at::rand({2, 6});  // no gradient for the input
  const at::Tensor probs = linear_chain_softmax(x, c.weights, c.biases);
  probs.select(1, 0).sum().backward();
  EXPECT_FALSE(c.weights[0].grad().defined());
  EXPECT_TRUE(c.biases[0].grad().defined());
  EXPECT_TRUE(c.weights[1].grad().defined());
  EXPECT_FALSE(x.grad().defined());
  const at::Tensor reference = layer_by_layer(x, c);
  EXPECT_TRUE(at::allclose(probs, reference, 1e-5, 1e-6));
}

TEST(LinearChainTest, WhatItDoesNotTakeGoesThroughATen) {
  Chain doubles({5, 4, 3}, at::kDouble);
  const at::Tensor x = at::rand({2, 5}, at::kDouble);
  EXPECT_FALSE(linear_chain_fits(x, doubles.weights, doubles.biases));
  EXPECT_TRUE(at::allclose(linear_chain_softmax(x, doubles.weights, doubles.biases),
                           layer_by_layer(x, doubles)));
  Chain big({kMaxChainMultiplyAdds / 4 + 1, 4});
  EXPECT_FALSE(linear_chain_fits(at::rand({1, kMaxChainMultiplyAdds / 4 + 1}), big.weights,
                                 big.biases));
  Chain mismatched({5, 4, 3});
  EXPECT_FALSE(linear_chain_fits(at::rand({2, 6}), mismatched.weights, mismatched.biases));
  mismatched.biases[1] = at::Tensor();
  EXPECT_FALSE(linear_chain_fits(at::rand({2, 5}), mismatched.weights, mismatched.biases));
}

}  // namespace
}  // namespace ddprpc::models
