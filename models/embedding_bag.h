// EmbeddingBag in sum mode with a dense weight gradient, as one autograd
// node in plain loops: what at::embedding_bag(weight, indices, offsets,
// scale_grad_by_freq=false, mode=sum) computes, without its per-call
// bookkeeping (ATen's backward sorts the indices and builds bag and count
// tables for every batch, which on a parameter server serving small
// batches costs more than the sums themselves).
//
// Each output row, and each row of the weight's gradient, is summed from
// zero in index order, as ATen's CPU kernels do, so values match theirs.
// Inputs are checked as ATen checks them, before anything is read:
// indices and offsets 1-D int64, offsets starting at 0, never decreasing
// and within the indices, every index a row of `weight`; a violation
// throws c10::Error (std::exception) naming it. Anything else (another
// dtype, a weight that is not 2-D float) goes through at::embedding_bag.
#pragma once

#include <ATen/core/Tensor.h>

namespace ddprpc::models {

at::Tensor embedding_bag_sum_dense(const at::Tensor& weight, const at::Tensor& indices,
                                   const at::Tensor& offsets);

}  // namespace ddprpc::models
