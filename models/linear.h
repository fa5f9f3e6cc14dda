// models::Linear: torch::nn::Linear (same parameters, initialization and
// options) whose forward and backward run their matrix products on XNNPACK.
//
// Debian's libtorch does its matmuls on netlib's reference BLAS, where a
// Linear(512, 256) costs ~1 ms forward + backward at batch 7; XNNPACK does
// the same in ~0.2 ms. XNNPACK's linear is inference-only and packs its
// weight, so each product is arranged to pack the small operand (the
// batch), never the weight matrix:
//   y  = x W^T + b        computed as (W x^T)^T   (packs x)
//   dx = dy W             computed as (W^T dy^T)^T (packs dy)
//   dW = dy^T x           computed as dy^T (x^T)^T (packs x^T)
// Autograd sees one node with the usual gradients for input, weight and
// bias, so DDP hooks and dist autograd work as with torch::nn::Linear (but
// the backward is not itself differentiable: no double backward).
// Inputs XNNPACK cannot take (not 2-D float CPU, empty, or XNNPACK missing
// from the build), and products too small to gain (under 32k multiply-adds,
// where XNNPACK's per-call setup dominates), go through at::linear.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace ddprpc::models {

// Where a dense layer's products run: XNNPACK (fast_linear below) or
// libtorch's own Linear kernel (at::linear on the build's BLAS; what
// PyTorch's torch.nn.Linear runs). Benchmarks compare runtimes with the
// same kernel on both sides by choosing kAten.
enum class DenseKernel { kXnnpack, kAten };
// "xnnpack" / "aten".
const char* dense_kernel_name(DenseKernel kernel);
// Parses a name above; false if it is neither.
bool parse_dense_kernel(std::string_view name, DenseKernel* out);
// Parses a comma list of names ("xnnpack,aten"); false, with *error saying
// why, if a name is unknown or none is given.
bool parse_dense_kernels(std::string_view csv, std::vector<DenseKernel>* out, std::string* error);

// True when this libtorch has XNNPACK's prepacked linear and it runs here
// (Debian's libtorch 1.13 has; PyTorch's x86 wheels of 2.x have not).
bool xnnpack_linear_available();

// The kernels a benchmark compares by default: "xnnpack,aten" where
// XNNPACK is available, else "aten" (the xnnpack kernel would run
// at::linear too).
std::string default_dense_kernels();

// y = x W^T + b for x [batch, in], W [out, in], b [out] (b may be undefined),
// differentiable in all three; falls back to at::linear (see above).
at::Tensor fast_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

namespace internal {
struct PackedWeightCache;
}

// A torch::nn::Linear whose forward is fast_linear. (clone() returns a plain
// torch::nn::LinearImpl: the inherited Cloneable knows only the base.)
//
// With cache_packed_weight(true) it is also XNNPACK's usual inference
// layer: once a forward sees the same weight and bias a second time, it
// packs them and runs later forwards on the packed copy (a few us instead of
// packing the batch each call), until the weight or bias changes. A change
// is seen through the tensors' version counters (copy_, add_ and other
// in-place ops on the parameter) and their storage (set_data). Writes that
// bypass them are not: into .data() or the raw memory, which is how
// libtorch's torch::optim optimizers step (and how a collective fills a
// parameter); call cache_packed_weight(true) again after those. Gradients
// are the same either way. Thread-safe: one thread at a time runs the
// packed copy, others meanwhile take the uncached path. Off by default: a
// training loop changes the weight after every forward, so packing it
// would not pay.
//
// The weight lives in memory with the tail padding XNNPACK reads past the
// end of its operands (from construction on; reset_parameters() and
// optimizers write into it in place): XNNPACK would copy a weight without
// it on every forward. A weight given another storage later (set_data,
// torch::load) works the same, with that copy.
class LinearImpl : public torch::nn::LinearImpl {
 public:
  LinearImpl(int64_t in_features, int64_t out_features);
  explicit LinearImpl(const torch::nn::LinearOptions& options);
  at::Tensor forward(const at::Tensor& input);
  // Turns the cache on (dropping what it holds) or off.
  void cache_packed_weight(bool on);
  // kAten: forward() is torch::nn::LinearImpl's (libtorch's kernel; the
  // cache is not used). kXnnpack (the default): as described above.
  void set_kernel(DenseKernel kernel) { kernel_ = kernel; }
  DenseKernel kernel() const { return kernel_; }

 private:
  // Moves the weight into padded memory (see above).
  void pad_weight();
  // forward() with the cache's lock held.
  at::Tensor forward_cached(internal::PackedWeightCache& cache, const at::Tensor& input);

  std::shared_ptr<internal::PackedWeightCache> cache_;  // null when off
  DenseKernel kernel_ = DenseKernel::kXnnpack;
};
TORCH_MODULE(Linear);

}  // namespace ddprpc::models
