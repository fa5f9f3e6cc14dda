#include "models/linear_chain.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/softmax.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace ddprpc::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Eight floats; one AVX register in the x86-64-v3 clones below, two SSE
// registers in the default ones. (Helpers take them by reference: passed by
// value, their calling convention would differ between the two.)
typedef float Floats8 __attribute__((vector_size(32)));

// Accumulates p[0..8) * q[0..8) into acc.
__attribute__((always_inline)) inline void fma8(Floats8& acc, const float* p, const float* q) {
  Floats8 x, y;
  std::memcpy(&x, p, sizeof x);
  std::memcpy(&y, q, sizeof y);
  acc += x * y;
}

__attribute__((always_inline)) inline float sum8(const Floats8& v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// h . w over n floats, with two independent accumulators.
__attribute__((always_inline)) inline float dot(const float* __restrict h,
                                                const float* __restrict w, int64_t n) {
  Floats8 a = {}, b = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    fma8(a, h + j, w + j);
    fma8(b, h + j + 8, w + j + 8);
  }
  for (; j + 8 <= n; j += 8) fma8(a, h + j, w + j);
  float tail = 0;
  for (; j < n; ++j) tail += h[j] * w[j];
  return tail + sum8(a + b);
}

// The dot products of rows h0 and h1 with the four rows of w (stride n):
// eight independent accumulators, each load of h or w used 4 or 2 times.
__attribute__((always_inline)) inline void dot_2x4(const float* __restrict h0,
                                                   const float* __restrict h1,
                                                   const float* __restrict w, int64_t n,
                                                   float* __restrict out0,
                                                   float* __restrict out1) {
  const float* const w0 = w;
  const float* const w1 = w + n;
  const float* const w2 = w + 2 * n;
  const float* const w3 = w + 3 * n;
  Floats8 a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    fma8(a0, h0 + j, w0 + j);
    fma8(b0, h1 + j, w0 + j);
    fma8(a1, h0 + j, w1 + j);
    fma8(b1, h1 + j, w1 + j);
    fma8(a2, h0 + j, w2 + j);
    fma8(b2, h1 + j, w2 + j);
    fma8(a3, h0 + j, w3 + j);
    fma8(b3, h1 + j, w3 + j);
  }
  out0[0] = sum8(a0), out0[1] = sum8(a1), out0[2] = sum8(a2), out0[3] = sum8(a3);
  out1[0] = sum8(b0), out1[1] = sum8(b1), out1[2] = sum8(b2), out1[3] = sum8(b3);
  for (; j < n; ++j) {
    for (int k = 0; k < 4; ++k) {
      out0[k] += h0[j] * w[k * n + j];
      out1[k] += h1[j] * w[k * n + j];
    }
  }
}

// out[r][o] = bias[o] + h[r] . w[o] for h [rows, in], w [outs, in]: two
// rows by four outputs at a time, so that eight sums are in flight (one
// sum alone waits on each multiply-add before the next) and every load
// serves several of them. Cloned for AVX2 + FMA (x86-64-v3: the ISA level,
// any vendor's CPU), chosen at load time where the CPU has them.
__attribute__((target_clones("arch=x86-64-v3", "default"))) void affine_rows(
    const float* __restrict h, const float* __restrict w, const float* __restrict bias,
    float* __restrict out, int64_t rows, int64_t in, int64_t outs) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    const float* const h0 = h + r * in;
    const float* const h1 = h0 + in;
    float* const out0 = out + r * outs;
    float* const out1 = out0 + outs;
    int64_t o = 0;
    for (; o + 4 <= outs; o += 4) dot_2x4(h0, h1, w + o * in, in, out0 + o, out1 + o);
    for (; o < outs; ++o) {
      out0[o] = dot(h0, w + o * in, in);
      out1[o] = dot(h1, w + o * in, in);
    }
    for (o = 0; o < outs; ++o) out0[o] += bias[o], out1[o] += bias[o];
  }
  for (; r < rows; ++r) {
    for (int64_t o = 0; o < outs; ++o) out[r * outs + o] = bias[o] + dot(h + r * in, w + o * in, in);
  }
}

// y[i] += a * x[i].
__attribute__((target_clones("arch=x86-64-v3", "default"))) void axpy(
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
  // Every layer's output goes to one buffer, `acts`: layer l's [rows,
  // out_l] at rows * (out_1 + ... + out_{l-1}). Backward reads the inputs
  // of layers 2..n there.
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs) {
    const size_t n = (inputs.size() - 1) / 2;
    const at::Tensor x = inputs[0].contiguous();
    const int64_t rows = x.size(0);
    int64_t total = 0;
    for (size_t l = 0; l < n; ++l) total += rows * inputs[1 + 2 * l].size(0);
    at::Tensor acts = at::empty({total}, x.options());
    const float* h = x.data_ptr<float>();
    float* out = acts.data_ptr<float>();
    for (size_t l = 0; l < n; ++l) {
      const at::Tensor w = inputs[1 + 2 * l].contiguous();
      const at::Tensor b = inputs[2 + 2 * l].contiguous();
      affine_rows(h, w.data_ptr<float>(), b.data_ptr<float>(), out, rows, w.size(1), w.size(0));
      h = out;
      out += rows * w.size(0);
    }
    const int64_t classes = inputs[2 * n - 1].size(0);  // the last layer's outputs
    at::Tensor probs = at::empty({rows, classes}, x.options());
    softmax_rows(h, probs.data_ptr<float>(), rows, classes);
    // Backward needs x, the weights, acts and probs; of a bias only its
    // size, which is its weight's first.
    std::vector<at::Tensor> saved;
    saved.reserve(n + 3);
    saved.push_back(inputs[0]);
    for (size_t l = 0; l < n; ++l) saved.push_back(inputs[1 + 2 * l]);
    saved.push_back(acts);
    saved.push_back(probs);
    ctx->save_for_backward(saved);
    return {probs};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const size_t n = saved.size() - 3;
    const at::Tensor probs = saved.back();
    const at::Tensor acts = saved[saved.size() - 2];
    const at::Tensor g = grads[0].contiguous();
    const int64_t rows = probs.size(0);
    at::Tensor dz = at::empty_like(probs);
    softmax_rows_backward(g.data_ptr<float>(), probs.data_ptr<float>(), dz.data_ptr<float>(),
                          rows, probs.size(1));
    // Where each layer's output starts in acts.
    std::vector<const float*> outputs(n);
    const float* next = acts.data_ptr<float>();
    for (size_t l = 0; l < n; ++l) {
      outputs[l] = next;
      next += rows * saved[1 + l].size(0);
    }
    const at::Tensor x = saved[0].contiguous();
    variable_list out(2 * n + 1);
    for (size_t l = n; l-- > 0;) {
      const at::Tensor w = saved[1 + l].contiguous();
      const float* const h = l == 0 ? x.data_ptr<float>() : outputs[l - 1];
      const int64_t in = w.size(1), outs = w.size(0);
      at::Tensor dw, db, dh;
      if (ctx->needs_input_grad(1 + 2 * l)) dw = at::empty_like(w);
      if (ctx->needs_input_grad(2 + 2 * l)) db = at::empty({outs}, w.options());
      if (l > 0 || ctx->needs_input_grad(0)) dh = at::empty({rows, in}, w.options());
      affine_backward(dz.data_ptr<float>(), h, w.data_ptr<float>(), rows, in,
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
