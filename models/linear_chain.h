// softmax(...((x W_1^T + b_1) W_2^T + b_2)... W_n^T + b_n, dim=-1): a
// chain of Linear layers without activations between them, then softmax
// (the policy of the RPC RL benchmark), as ONE autograd node.
//
// Layer by layer that is 2n + 1 ops, each paying libtorch's dispatch,
// an output allocation and an autograd node: for layers of a few thousand
// multiply-adds that costs more than the products. Here the products run
// in plain loops (cloned for AVX2 + FMA) and backward gives x, every W_i
// and every b_i the gradients the layer-by-layer graph would give (up to
// float rounding; no double backward).
//
// Takes float, 2-D x [batch, in] and weights [out_i, in_i] with
// in_1 == in and in_{i+1} == out_i, biases [out_i] (all defined);
// anything else, or a chain of more than kMaxChainMultiplyAdds per row, goes
// through at::linear and at::softmax as before.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ddprpc::models {

// Beyond this many multiply-adds per input row, BLAS or XNNPACK per layer
// beats plain loops.
inline constexpr int64_t kMaxChainMultiplyAdds = int64_t{1} << 16;

at::Tensor linear_chain_softmax(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                const std::vector<at::Tensor>& biases);

// Whether linear_chain_softmax takes these as one node (see above).
bool linear_chain_fits(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                       const std::vector<at::Tensor>& biases);

}  // namespace ddprpc::models
