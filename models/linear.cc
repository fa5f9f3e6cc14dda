#include "models/linear.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
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
// refuses tensors that require grad: both are detached. Each op makes its
// operand contiguous itself, the run into a padded buffer: no copies here.)
at::Tensor matmul_bt(const XnnOps& ops, const at::Tensor& a, const at::Tensor& b) {
  std::vector<c10::IValue> stack{b.detach(), c10::IValue(), c10::IValue(), c10::IValue()};
  ops.prepack.callBoxed(&stack);
  c10::IValue packed = std::move(stack[0]);
  stack = {a.detach(), std::move(packed)};
  ops.run.callBoxed(&stack);
  return stack[0].toTensor();
}

// y = x W^T (+ b), the products arranged as in linear.h. The bias is
// optional (an empty optional is not an input of the autograd node).
class XnnLinear : public torch::autograd::Function<XnnLinear> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["has_bias"] = bias.has_value();
    at::Tensor yt = matmul_bt(*xnn_ops(), weight, x);  // [out, batch]
    if (bias) yt = yt + bias->detach().unsqueeze(1);
    return yt.t().contiguous();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    at::NoGradGuard no_grad;  // no double backward
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor dy = grads[0].contiguous();  // [batch, out]
    const XnnOps& ops = *xnn_ops();
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) dx = matmul_bt(ops, weight.t(), dy).t().contiguous();
    if (ctx->needs_input_grad(1)) dw = matmul_bt(ops, dy.t(), x.t());
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) db = dy.sum(0);
    return {dx, dw, db};
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
  return XnnLinear::apply(x, weight,
                          bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
}

}  // namespace ddprpc::models
