#include "models/embedding_bag.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/embedding_bag.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <vector>

#include "gtest/gtest.h"

namespace ddprpc::models {
namespace {

at::Tensor longs(std::vector<int64_t> v) { return at::tensor(v, at::kLong); }

at::Tensor aten_bag(const at::Tensor& w, const at::Tensor& indices, const at::Tensor& offsets) {
  return std::get<0>(at::embedding_bag(w, indices, offsets, false, /*mode=sum*/ 0));
}

TEST(EmbeddingBagTest, SameValuesAndGradientsAsATen) {
  const at::Tensor weight = at::randn({30, 19}).requires_grad_();
  // Repeated rows, a bag of one, an empty bag in the middle and a last bag.
  const at::Tensor indices = longs({3, 7, 3, 29, 0, 7, 7, 12, 3, 5});
  const at::Tensor offsets = longs({0, 3, 4, 4, 8});
  const at::Tensor fused = embedding_bag_sum_dense(weight, indices, offsets);
  const at::Tensor reference = aten_bag(weight, indices, offsets);
  EXPECT_TRUE(at::equal(fused, reference));
  ASSERT_NE(fused.grad_fn(), nullptr);
  EXPECT_EQ(fused.grad_fn()->next_edges().size(), 3u);

  const at::Tensor g = at::randn(fused.sizes());
  const at::Tensor got = torch::autograd::grad({(fused * g).sum()}, {weight})[0];
  const at::Tensor want = torch::autograd::grad({(reference * g).sum()}, {weight})[0];
  EXPECT_FALSE(got.is_sparse());
  EXPECT_TRUE(at::allclose(got, want, 0, 1e-6));
  // Rows never looked up get no gradient.
  EXPECT_EQ(got[1].abs().sum().item<float>(), 0.0f);
}

TEST(EmbeddingBagTest, BadBagsAreRefusedBeforeAnythingIsRead) {
  const at::Tensor weight = at::randn({10, 4}).requires_grad_();
  auto refuses = [&](const at::Tensor& indices, const at::Tensor& offsets, const char* why) {
    try {
      embedding_bag_sum_dense(weight, indices, offsets);
      ADD_FAILURE() << "accepted: " << why;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  refuses(longs({1, 10}), longs({0}), "index 10 is out of range for a table of 10 rows");
  refuses(longs({-1, 2}), longs({0}), "index -1 is out of range");
  refuses(longs({1, 2}), longs({1}), "offsets[0] must be 0");
  refuses(longs({1, 2, 3}), longs({0, 2, 1}), "offsets must not decrease");
  refuses(longs({1, 2}), longs({0, 3}), "is past the 2 indices");
  refuses(longs({1, 2}).view({1, 2}), longs({0}), "indices must be 1-D");
}

TEST(EmbeddingBagTest, WhatItDoesNotTakeGoesThroughATen) {
  const at::Tensor weight = at::randn({10, 4}, at::kDouble);
  const at::Tensor indices = longs({1, 2, 3}), offsets = longs({0, 1});
  EXPECT_TRUE(at::equal(embedding_bag_sum_dense(weight, indices, offsets),
                        aten_bag(weight, indices, offsets)));
  const at::Tensor ints = at::tensor(std::vector<int32_t>{1, 2, 3}, at::kInt);
  const at::Tensor w = at::randn({10, 4});
  EXPECT_TRUE(at::equal(embedding_bag_sum_dense(w, ints, at::tensor(std::vector<int32_t>{0, 1}, at::kInt)),
                        aten_bag(w, ints, at::tensor(std::vector<int32_t>{0, 1}, at::kInt))));
}

}  // namespace
}  // namespace ddprpc::models
