#include "models/linear.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"

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

// Up to this batch, dx = dy W is computed by dy_times_w below rather than
// on XNNPACK, whose kernel would take W transposed: a copy of the whole
// weight per backward (the 512x256 layer at batch 7: ~130 us, of which
// ~70 us is that copy). ddp_rpc 2x2, dim 256: backward 1.95-2.05 ->
// 1.90-1.93 ms per batch.
constexpr int64_t kMaxDirectBatch = 32;

// dx = dy W for dy [b, out] and W [out, in], all row-major and contiguous.
// Four rows of W at a time are scaled into each row of dx, which stays in
// L1 for small b: W is read once, no copy of it is made. Cloned for AVX2 +
// FMA, chosen at load time where the CPU has them.
__attribute__((target_clones("arch=x86-64-v3", "default"))) void dy_times_w(
    const float* __restrict dy, const float* __restrict w, float* __restrict dx, int64_t b,
    int64_t out, int64_t in) {
  std::fill(dx, dx + b * in, 0.0f);
  int64_t o = 0;
  for (; o + 4 <= out; o += 4) {
    const float* __restrict w0 = w + o * in;
    const float* __restrict w1 = w0 + in;
    const float* __restrict w2 = w1 + in;
    const float* __restrict w3 = w2 + in;
    for (int64_t i = 0; i < b; ++i) {
      const float* s = dy + i * out + o;
      const float s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3];
      float* __restrict dxi = dx + i * in;
      for (int64_t j = 0; j < in; ++j) {
        dxi[j] += s0 * w0[j] + s1 * w1[j] + s2 * w2[j] + s3 * w3[j];
      }
    }
  }
  for (; o < out; ++o) {
    const float* __restrict wo = w + o * in;
    for (int64_t i = 0; i < b; ++i) {
      const float s0 = dy[i * out + o];
      float* __restrict dxi = dx + i * in;
      for (int64_t j = 0; j < in; ++j) dxi[j] += s0 * wo[j];
    }
  }
}

// Gradients of y = x W^T (+ b) for input, weight and bias, the products
// arranged as in linear.h (ctx saved x, W and whether there is a bias).
torch::autograd::variable_list linear_backward(torch::autograd::AutogradContext* ctx,
                                               const torch::autograd::variable_list& grads) {
  at::NoGradGuard no_grad;  // no double backward
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& x = saved[0];
  const at::Tensor& weight = saved[1];
  const at::Tensor dy = grads[0].contiguous();  // [batch, out]
  const XnnOps& ops = *xnn_ops();
  at::Tensor dx, dw, db;
  if (ctx->needs_input_grad(0)) {
    if (dy.size(0) <= kMaxDirectBatch && weight.is_contiguous()) {
      dx = at::empty({dy.size(0), weight.size(1)}, dy.options());
      dy_times_w(dy.data_ptr<float>(), weight.data_ptr<float>(), dx.data_ptr<float>(),
                 dy.size(0), weight.size(0), weight.size(1));
    } else {
      dx = matmul_bt(ops, weight.t(), dy).t().contiguous();
    }
  }
  if (ctx->needs_input_grad(1)) dw = matmul_bt(ops, dy.t(), x.t());
  if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) db = dy.sum(0);
  return {dx, dw, db};
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
    return linear_backward(ctx, grads);
  }
};

// The same with W and b already packed (`packed`, from linear_clamp_prepack).
class XnnLinearPacked : public torch::autograd::Function<XnnLinearPacked> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                            c10::IValue packed) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["has_bias"] = bias.has_value();
    std::vector<c10::IValue> stack{x.detach(), std::move(packed)};
    xnn_ops()->run.callBoxed(&stack);
    return stack[0].toTensor();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list out = linear_backward(ctx, grads);
    out.emplace_back();  // `packed` is not differentiable
    return out;
  }
};

// Below this many multiply-adds per product, XNNPACK's per-call operator
// setup costs more than reference BLAS saves (measured: a 10x10 layer takes
// 1.6 us on at::linear and 3.1 us here; 128x64 at batch 7, 57k MACs, takes
// 22 us and 7.6 us).
constexpr int64_t kMinMacs = 32 * 1024;

bool plain(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.layout() == at::kStrided;
}

// Whether XNNPACK can take the product at all (a packed weight then pays
// at any size); `min_macs` is the size from which packing the batch pays.
bool xnnpack_takes(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                   int64_t min_macs = kMinMacs) {
  return x.dim() == 2 && weight.dim() == 2 && x.numel() > 0 && weight.numel() > 0 &&
         x.size(0) * weight.numel() >= min_macs &&
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

namespace internal {

// What identifies the weight or bias a packed copy was made from: its
// storage (held weakly, so a new storage at a freed one's address is not
// taken for it), where the tensor starts in it, and its version counter.
struct ParamKey {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
  const void* data = nullptr;
  int64_t version = 0;

  static ParamKey of(const at::Tensor& t) {
    if (!t.defined()) return {};
    return {t.storage().getWeakStorageImpl(), t.data_ptr(), t._version()};
  }
  bool same_as(const at::Tensor& t) const {
    if (!t.defined()) return data == nullptr;
    return !storage.expired() && storage._unsafe_get_target() == t.storage().unsafeGetStorageImpl() &&
           data == t.data_ptr() && version == t._version();
  }
};

struct PackedWeightCache {
  // Held for the packed run too: XNNPACK's operator keeps the run's input
  // and output in itself, so two threads may not run it at once.
  absl::Mutex mu;
  // State below is protected by mu.
  ParamKey weight ABSL_GUARDED_BY(mu);
  ParamKey bias ABSL_GUARDED_BY(mu);
  c10::IValue packed ABSL_GUARDED_BY(mu);  // None until packed for the keys
};

}  // namespace internal

std::string default_dense_kernels() { return xnnpack_linear_available() ? "xnnpack,aten" : "aten"; }

const char* dense_kernel_name(DenseKernel kernel) {
  return kernel == DenseKernel::kAten ? "aten" : "xnnpack";
}

bool parse_dense_kernel(std::string_view name, DenseKernel* out) {
  if (name == "xnnpack") return (*out = DenseKernel::kXnnpack), true;
  if (name == "aten") return (*out = DenseKernel::kAten), true;
  return false;
}

bool parse_dense_kernels(std::string_view csv, std::vector<DenseKernel>* out, std::string* error) {
  out->clear();
  for (absl::string_view piece : absl::StrSplit(absl::string_view(csv.data(), csv.size()), ',',
                                                absl::SkipWhitespace())) {
    const absl::string_view name = absl::StripAsciiWhitespace(piece);
    DenseKernel k;
    if (!parse_dense_kernel(std::string_view(name.data(), name.size()), &k)) {
      *error = absl::StrCat("'", name, "' is neither xnnpack nor aten");
      return false;
    }
    out->push_back(k);
  }
  if (out->empty()) *error = "no kernel named";
  return !out->empty();
}

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features)
    : LinearImpl(torch::nn::LinearOptions(in_features, out_features)) {}

LinearImpl::LinearImpl(const torch::nn::LinearOptions& options)
    : torch::nn::LinearImpl(options) {
  pad_weight();
}

void LinearImpl::pad_weight() {
  // XNNPACK's linear run takes its input as is only from the mobile
  // allocator (which pads every buffer); the forward runs the weight
  // against the packed batch, so the weight is that input.
  if (!weight.defined() || !plain(weight) || !weight.is_contiguous()) return;
  at::NoGradGuard no_grad;
  at::Tensor padded = at::detail::empty_generic(
      weight.sizes(), c10::GetDefaultMobileCPUAllocator(),
      c10::DispatchKeySet(c10::DispatchKey::CPU), weight.scalar_type(), c10::nullopt);
  padded.copy_(weight);
  weight.set_data(padded);
}

void LinearImpl::cache_packed_weight(bool on) {
  std::atomic_store(&cache_, on ? std::make_shared<internal::PackedWeightCache>() : nullptr);
}

at::Tensor LinearImpl::forward(const at::Tensor& input) {
  if (kernel_ == DenseKernel::kAten) return torch::nn::LinearImpl::forward(input);
  std::shared_ptr<internal::PackedWeightCache> cache = std::atomic_load(&cache_);
  // While another thread runs the packed copy, this one packs its batch
  // instead of waiting.
  if (!cache || !xnnpack_takes(input, weight, bias, /*min_macs=*/0) || !cache->mu.TryLock()) {
    return fast_linear(input, weight, bias);
  }
  struct Unlock {
    absl::Mutex& mu;
    ~Unlock() { mu.Unlock(); }
  } unlock{cache->mu};
  return forward_cached(*cache, input);
}

at::Tensor LinearImpl::forward_cached(internal::PackedWeightCache& cache, const at::Tensor& input) {
  if (!cache.weight.same_as(weight) || !cache.bias.same_as(bias)) {
    cache.weight = internal::ParamKey::of(weight);  // the first forward at these keys
    cache.bias = internal::ParamKey::of(bias);
    cache.packed = c10::IValue();
    return fast_linear(input, weight, bias);
  }
  if (cache.packed.isNone()) {  // the second forward at these keys
    at::NoGradGuard no_grad;
    std::vector<c10::IValue> stack{
        weight.detach().contiguous(),
        bias.defined() ? c10::IValue(bias.detach().contiguous()) : c10::IValue(), c10::IValue(),
        c10::IValue()};
    xnn_ops()->prepack.callBoxed(&stack);
    cache.packed = std::move(stack[0]);
  }
  return XnnLinearPacked::apply(input, weight,
                                bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt,
                                cache.packed);
}

}  // namespace ddprpc::models
