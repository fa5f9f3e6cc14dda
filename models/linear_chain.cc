#include "models/linear_chain.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/softmax.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>

namespace ddprpc::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// out[r][o] = bias[o] + h[r] . w[o] for h [rows, in], w [outs, in]. Eight
// partial sums per dot product, so that the compiler can keep them in one
// vector register.
__attribute__((target_clones("arch=haswell", "default"))) void affine_rows(
    const float* __restrict h, const float* __restrict w, const float* __restrict bias,
    float* __restrict out, int64_t rows, int64_t in, int64_t outs) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict hr = h + r * in;
    for (int64_t o = 0; o < outs; ++o) {
      const float* __restrict wo = w + o * in;
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t j = 0;
      for (; j + 8 <= in; j += 8) {
        for (int k = 0; k < 8; ++k) part[k] += hr[j + k] * wo[j + k];
      }
      float sum = 0;
      for (; j < in; ++j) sum += hr[j] * wo[j];
      for (int k = 0; k < 8; ++k) sum += part[k];
      out[r * outs + o] = bias[o] + sum;
    }
  }
}

// y[i] += a * x[i].
__attribute__((target_clones("arch=haswell", "default"))) void axpy(
    float a, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// Gradients of out = h w^T + bias from dz [rows, outs]: dw [outs, in] and
// db [outs] (when not null), and dh [rows, in] (when not null).
void affine_backward(const float* dz, const float* h, const float* w, int64_t rows, int64_t in,
                     int64_t outs, float* dw, float* db, float* dh) {
  if (dw != nullptr) {
    std::fill(dw, dw + outs * in, 0.0f);
    for (int64_t o = 0; o < outs; ++o) {
      for (int64_t r = 0; r < rows; ++r) axpy(dz[r * outs + o], h + r * in, dw + o * in, in);
    }
  }
  if (db != nullptr) {
    for (int64_t o = 0; o < outs; ++o) {
      float sum = 0;
      for (int64_t r = 0; r < rows; ++r) sum += dz[r * outs + o];
      db[o] = sum;
    }
  }
  if (dh != nullptr) {
    std::fill(dh, dh + rows * in, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < outs; ++o) axpy(dz[r * outs + o], w + o * in, dh + r * in, in);
    }
  }
}

void softmax_rows(const float* z, float* p, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* zr = z + r * n;
    float* pr = p + r * n;
    const float top = *std::max_element(zr, zr + n);
    float sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += (pr[i] = std::exp(zr[i] - top));
    for (int64_t i = 0; i < n; ++i) pr[i] /= sum;
  }
}

// dz = p * (g - sum(g * p)) per row.
void softmax_rows_backward(const float* g, const float* p, float* dz, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float dot = 0;
    for (int64_t i = 0; i < n; ++i) dot += g[r * n + i] * p[r * n + i];
    for (int64_t i = 0; i < n; ++i) dz[r * n + i] = p[r * n + i] * (g[r * n + i] - dot);
  }
}

// Inputs x, W_1, b_1, ..., W_n, b_n; one output, the probabilities.
class LinearChainSoftmax : public torch::autograd::Function<LinearChainSoftmax> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs) {
    const size_t n = (inputs.size() - 1) / 2;
    at::Tensor h = inputs[0].contiguous();
    const int64_t rows = h.size(0);
    c10::List<at::Tensor> hidden;  // inputs of layers 2..n
    for (size_t l = 0; l < n; ++l) {
      const at::Tensor w = inputs[1 + 2 * l].contiguous();
      const at::Tensor b = inputs[2 + 2 * l].contiguous();
      at::Tensor out = at::empty({rows, w.size(0)}, h.options());
      affine_rows(h.data_ptr<float>(), w.data_ptr<float>(), b.data_ptr<float>(),
                  out.data_ptr<float>(), rows, w.size(1), w.size(0));
      if (l + 1 < n) hidden.push_back(out);
      h = out;
    }
    at::Tensor probs = at::empty_like(h);
    softmax_rows(h.data_ptr<float>(), probs.data_ptr<float>(), rows, h.size(1));
    std::vector<at::Tensor> saved(inputs.begin(), inputs.end());
    saved.push_back(probs);
    ctx->save_for_backward(saved);
    ctx->saved_data["hidden"] = hidden;
    return {probs};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const size_t n = (saved.size() - 2) / 2;
    const at::Tensor probs = saved.back();
    const c10::List<at::Tensor> hidden = ctx->saved_data["hidden"].toTensorList();
    const at::Tensor g = grads[0].contiguous();
    const int64_t rows = probs.size(0);
    at::Tensor dz = at::empty_like(probs);
    softmax_rows_backward(g.data_ptr<float>(), probs.data_ptr<float>(), dz.data_ptr<float>(),
                          rows, probs.size(1));
    variable_list out(saved.size() - 1);
    for (size_t l = n; l-- > 0;) {
      const at::Tensor w = saved[1 + 2 * l].contiguous();
      const at::Tensor h = l == 0 ? saved[0].contiguous() : hidden.get(l - 1);
      const int64_t in = w.size(1), outs = w.size(0);
      at::Tensor dw, db, dh;
      if (ctx->needs_input_grad(1 + 2 * l)) dw = at::empty_like(w);
      if (ctx->needs_input_grad(2 + 2 * l)) db = at::empty({outs}, w.options());
      if (l > 0 || ctx->needs_input_grad(0)) dh = at::empty({rows, in}, w.options());
      affine_backward(dz.data_ptr<float>(), h.data_ptr<float>(), w.data_ptr<float>(), rows, in,
                      outs, dw.defined() ? dw.data_ptr<float>() : nullptr,
                      db.defined() ? db.data_ptr<float>() : nullptr,
                      dh.defined() ? dh.data_ptr<float>() : nullptr);
      out[1 + 2 * l] = dw;
      out[2 + 2 * l] = db;
      dz = dh;
    }
    out[0] = dz;
    return out;
  }
};

bool is_float_matrix(const at::Tensor& t) {
  return t.defined() && t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu() &&
         t.layout() == c10::kStrided;
}

}  // namespace

bool linear_chain_fits(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                       const std::vector<at::Tensor>& biases) {
  if (weights.empty() || weights.size() != biases.size() || !is_float_matrix(x)) return false;
  int64_t in = x.size(1), multiply_adds = 0;
  for (size_t l = 0; l < weights.size(); ++l) {
    const at::Tensor& w = weights[l];
    const at::Tensor& b = biases[l];
    if (!is_float_matrix(w) || w.size(1) != in || w.size(0) < 1) return false;
    if (!b.defined() || b.dim() != 1 || b.size(0) != w.size(0) ||
        b.scalar_type() != at::kFloat || !b.device().is_cpu() || b.layout() != c10::kStrided) {
      return false;
    }
    multiply_adds += w.size(0) * in;
    in = w.size(0);
  }
  return x.size(0) > 0 && multiply_adds <= kMaxChainMultiplyAdds;
}

at::Tensor linear_chain_softmax(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                const std::vector<at::Tensor>& biases) {
  if (!linear_chain_fits(x, weights, biases)) {
    at::Tensor h = x;
    for (size_t l = 0; l < weights.size(); ++l) h = at::linear(h, weights[l], biases[l]);
    return at::softmax(h, -1);
  }
  std::vector<at::Tensor> inputs{x};
  for (size_t l = 0; l < weights.size(); ++l) {
    inputs.push_back(weights[l]);
    inputs.push_back(biases[l]);
  }
  return LinearChainSoftmax::apply(at::TensorList(inputs))[0];
}

}  // namespace ddprpc::models
