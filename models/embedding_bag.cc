#include "models/embedding_bag.h"

#include <ATen/ops/embedding_bag.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>

namespace ddprpc::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// y += x, n floats.
__attribute__((target_clones("arch=x86-64-v3", "default"))) void add_row(
    const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void check_bags(const at::Tensor& indices, const at::Tensor& offsets, int64_t rows) {
  TORCH_CHECK(indices.dim() == 1, "embedding_bag: indices must be 1-D, got ", indices.dim(), "-D");
  TORCH_CHECK(offsets.dim() == 1, "embedding_bag: offsets must be 1-D, got ", offsets.dim(), "-D");
  const int64_t n = indices.numel(), bags = offsets.numel();
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(bags == 0 || off[0] == 0, "embedding_bag: offsets[0] must be 0, got ", bags ? off[0] : 0);
  for (int64_t b = 1; b < bags; ++b) {
    TORCH_CHECK(off[b] >= off[b - 1], "embedding_bag: offsets must not decrease (offsets[", b,
                "] = ", off[b], " < ", off[b - 1], ")");
  }
  TORCH_CHECK(bags == 0 || off[bags - 1] <= n, "embedding_bag: offsets[", bags - 1, "] = ",
              off[bags - 1], " is past the ", n, " indices");
  const int64_t* idx = indices.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_INDEX(idx[i] >= 0 && idx[i] < rows, "embedding_bag: index ", idx[i],
                      " is out of range for a table of ", rows, " rows");
  }
}

// Calls f(bag, index position) for every index of every bag, in order.
template <typename F>
void for_each_index(const int64_t* off, int64_t bags, int64_t n, F f) {
  for (int64_t b = 0; b < bags; ++b) {
    const int64_t end = b + 1 < bags ? off[b + 1] : n;
    for (int64_t i = off[b]; i < end; ++i) f(b, i);
  }
}

class EmbeddingBagSum : public torch::autograd::Function<EmbeddingBagSum> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& weight,
                            const at::Tensor& indices, const at::Tensor& offsets) {
    const at::Tensor w = weight.contiguous();
    const int64_t rows = w.size(0), dim = w.size(1);
    const at::Tensor idx = indices.contiguous(), off = offsets.contiguous();
    check_bags(idx, off, rows);
    const int64_t bags = off.numel();
    at::Tensor out = at::zeros({bags, dim}, w.options());
    const float* src = w.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    const int64_t* ip = idx.data_ptr<int64_t>();
    for_each_index(off.data_ptr<int64_t>(), bags, idx.numel(), [&](int64_t b, int64_t i) {
      add_row(src + ip[i] * dim, dst + b * dim, dim);
    });
    ctx->saved_data["indices"] = idx;
    ctx->saved_data["offsets"] = off;
    ctx->saved_data["rows"] = rows;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!ctx->needs_input_grad(0)) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor idx = ctx->saved_data["indices"].toTensor();
    const at::Tensor off = ctx->saved_data["offsets"].toTensor();
    const int64_t rows = ctx->saved_data["rows"].toInt();
    const at::Tensor g = grads[0].contiguous();
    const int64_t dim = g.size(1);
    at::Tensor gw = at::zeros({rows, dim}, g.options());
    const float* src = g.data_ptr<float>();
    float* dst = gw.data_ptr<float>();
    const int64_t* ip = idx.data_ptr<int64_t>();
    for_each_index(off.data_ptr<int64_t>(), off.numel(), idx.numel(), [&](int64_t b, int64_t i) {
      add_row(src + b * dim, dst + ip[i] * dim, dim);
    });
    return {gw, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor embedding_bag_sum_dense(const at::Tensor& weight, const at::Tensor& indices,
                                   const at::Tensor& offsets) {
  const bool fits = weight.dim() == 2 && weight.scalar_type() == at::kFloat &&
                    weight.device().is_cpu() && weight.layout() == c10::kStrided &&
                    indices.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong &&
                    indices.device().is_cpu() && offsets.device().is_cpu() &&
                    indices.layout() == c10::kStrided && offsets.layout() == c10::kStrided;
  if (!fits) {
    return std::get<0>(at::embedding_bag(weight, indices, offsets, /*scale_grad_by_freq=*/false,
                                         /*mode=sum*/ 0));
  }
  return EmbeddingBagSum::apply(weight, indices, offsets);
}

}  // namespace ddprpc::models
