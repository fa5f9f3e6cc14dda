#include "models/linear.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <tuple>
#include <vector>

namespace ddprpc::models {
namespace {

// XNNPACK's prepacked linear, as the dispatcher exposes it.
struct XnnOps {
  c10::OperatorHandle prepack, run;
};

const XnnOps* xnn_ops() {
  static const std::optional<XnnOps> ops = []() -> std::optional<XnnOps> {
    auto& dispatcher = c10::Dispatcher::singleton();
    auto prepack = dispatcher.findSchema({"prepacked::linear_clamp_prepack", ""});
    auto run = dispatcher.findSchema({"prepacked::linear_clamp_run", ""});
    if (!prepack || !run) return std::nullopt;
    return XnnOps{*prepack, *run};
  }();
  return ops ? &*ops : nullptr;
}

// a [m, k] times b [n, k] transposed: a b^T, [m, n]. Packs b. (XNNPACK
// refuses tensors that require grad: both are detached.)
at::Tensor matmul_bt(const XnnOps& ops, const at::Tensor& a, const at::Tensor& b) {
  std::vector<c10::IValue> stack{b.detach().contiguous(), c10::IValue(), c10::IValue(),
                                 c10::IValue()};
  ops.prepack.callBoxed(&stack);
  c10::IValue packed = std::move(stack[0]);
  stack = {a.detach().contiguous(), std::move(packed)};
  ops.run.callBoxed(&stack);
  return stack[0].toTensor();
}

// y = x W^T (+ b); the products arranged as in linear.h. Two autograd
// Functions, with and without bias, because a Function's tensor arguments
// must be defined.
at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias) {
  at::Tensor yt = matmul_bt(*xnn_ops(), weight, x);  // [out, batch]
  if (bias) yt = yt + bias->detach().unsqueeze(1);
  return yt.t().contiguous();
}

// Gradients for input and weight (undefined where not needed) and the
// incoming gradient, contiguous.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward(
    torch::autograd::AutogradContext* ctx, const at::Tensor& grad) {
  at::NoGradGuard no_grad;
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& x = saved[0];
  const at::Tensor& weight = saved[1];
  at::Tensor dy = grad.contiguous();  // [batch, out]
  const XnnOps& ops = *xnn_ops();
  at::Tensor dx, dw;
  if (ctx->needs_input_grad(0)) dx = matmul_bt(ops, weight.t(), dy).t().contiguous();
  if (ctx->needs_input_grad(1)) dw = matmul_bt(ops, dy.t(), x.t());
  return {dx, dw, dy};
}

class XnnLinear : public torch::autograd::Function<XnnLinear> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& bias) {
    ctx->save_for_backward({x, weight});
    return linear_forward(x, weight, &bias);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto [dx, dw, dy] = linear_backward(ctx, grads[0]);
    return {dx, dw, ctx->needs_input_grad(2) ? dy.sum(0) : at::Tensor()};
  }
};

class XnnLinearNoBias : public torch::autograd::Function<XnnLinearNoBias> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight) {
    ctx->save_for_backward({x, weight});
    return linear_forward(x, weight, nullptr);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto [dx, dw, dy] = linear_backward(ctx, grads[0]);
    return {dx, dw};
  }
};

// Below this many multiply-adds per product, XNNPACK's per-call operator
// setup costs more than reference BLAS saves (measured: a 10x10 layer takes
// 1.6 us on at::linear and 3.1 us here; 128x64 at batch 7, 57k MACs, takes
// 22 us and 7.6 us).
constexpr int64_t kMinMacs = 32 * 1024;

bool xnnpack_takes(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  auto plain = [](const at::Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.layout() == at::kStrided;
  };
  return x.dim() == 2 && weight.dim() == 2 && x.numel() > 0 && weight.numel() > 0 &&
         x.size(0) * weight.numel() >= kMinMacs &&
         x.size(1) == weight.size(1) && plain(x) && plain(weight) &&
         (!bias.defined() || (plain(bias) && bias.dim() == 1 && bias.size(0) == weight.size(0))) &&
         xnnpack_linear_available();
}

}  // namespace

bool xnnpack_linear_available() {
  // The ops may be registered yet fail at run time (XNNPACK checks the CPU
  // when it initializes): try one small product once.
  static const bool available = [] {
    const XnnOps* ops = xnn_ops();
    if (!ops) return false;
    try {
      at::NoGradGuard no_grad;
      at::Tensor a = at::ones({2, 3}), b = at::ones({4, 3});
      return matmul_bt(*ops, a, b).sizes() == at::IntArrayRef({2, 4});
    } catch (const std::exception&) {
      return false;
    }
  }();
  return available;
}

at::Tensor fast_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!xnnpack_takes(x, weight, bias)) return at::linear(x, weight, bias);
  return bias.defined() ? XnnLinear::apply(x, weight, bias) : XnnLinearNoBias::apply(x, weight);
}

}  // namespace ddprpc::models
