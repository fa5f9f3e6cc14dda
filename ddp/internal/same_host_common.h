// The element loops of the Gloo group's reductions, and two steps of the
// same-host allreduces' setup over the group.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <gloo/algorithm.h>
#include <gloo/allgather.h>
#include <gloo/context.h>
#include <gloo/math.h>
#include <gloo/types.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace ddprpc::ddp::internal {

enum class Reduction { kSum, kMin, kMax };

// The element loops run on the calling thread: ATen's kernels would start
// an intra-op team per piece, and with several ranks on few cores its
// spinning threads cost more than the reduction. Gloo's own loops
// (gloo/math.h) serve every dtype but half: built without AVX, as
// Debian's is, they assign through gloo::float16's operator=, which skips
// the store when the new bits equal the half encoding of the old bits read
// as an integer (its operator!= compares with rhs.x), so some results keep
// the destination's previous value. Half goes through c10::Half and float.

// out[i] = op(a[i], b[i]) for n elements; out may be a or b.
using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t n);

// Sums of float and double in vector steps (Gloo's loops compile to one
// scalar add per element here); the same results as gloo::sum.
void sum_float(void* out, const void* a, const void* b, size_t n);
void sum_double(void* out, const void* a, const void* b, size_t n);

template <typename Op>
void half_loop(void* out, const void* a, const void* b, size_t n) {
  static_assert(sizeof(c10::Half) == sizeof(gloo::float16));
  auto* o = static_cast<c10::Half*>(out);
  const auto* x = static_cast<const c10::Half*>(a);
  const auto* y = static_cast<const c10::Half*>(b);
  for (size_t i = 0; i < n; ++i) {
    o[i] = c10::Half(Op()(static_cast<float>(x[i]), static_cast<float>(y[i])));
  }
}
struct HalfSum {
  float operator()(float a, float b) const { return a + b; }
};
struct HalfMin {
  float operator()(float a, float b) const { return b < a ? b : a; }
};
struct HalfMax {
  float operator()(float a, float b) const { return a < b ? b : a; }
};

// In place, as gloo::ReductionFunction takes them: x[i] = op(x[i], y[i]).
template <typename Op>
void half_in_place(gloo::float16* x, const gloo::float16* y, size_t n) {
  half_loop<Op>(x, x, y, n);
}

template <typename T>
ReduceFn reduce_fn(Reduction op) {
  if constexpr (std::is_same_v<T, gloo::float16>) {
    if (op == Reduction::kMin) return &half_loop<HalfMin>;
    if (op == Reduction::kMax) return &half_loop<HalfMax>;
    return &half_loop<HalfSum>;
  } else {
    if (op == Reduction::kMin) return &gloo::min<T>;
    if (op == Reduction::kMax) return &gloo::max<T>;
    if constexpr (std::is_same_v<T, float>) return &sum_float;
    if constexpr (std::is_same_v<T, double>) return &sum_double;
    return &gloo::sum<T>;
  }
}

// The reduction Gloo's bound algorithms (gloo::AllreduceHalvingDoubling)
// apply, with the half loops above for half.
template <typename T>
const gloo::ReductionFunction<T>* reduction_function(Reduction op) {
  if constexpr (std::is_same_v<T, gloo::float16>) {
    static const auto* sum = new gloo::ReductionFunction<T>(gloo::SUM, &half_in_place<HalfSum>);
    static const auto* min = new gloo::ReductionFunction<T>(gloo::MIN, &half_in_place<HalfMin>);
    static const auto* max = new gloo::ReductionFunction<T>(gloo::MAX, &half_in_place<HalfMax>);
    return op == Reduction::kMin ? min : op == Reduction::kMax ? max : sum;
  } else {
    return op == Reduction::kMin   ? gloo::ReductionFunction<T>::min
           : op == Reduction::kMax ? gloo::ReductionFunction<T>::max
                                   : gloo::ReductionFunction<T>::sum;
  }
}

// Throws std::invalid_argument for a dtype other than float, double,
// int64, int32 and half.
inline ReduceFn reduce_fn(at::ScalarType type, Reduction op) {
  switch (type) {
    case at::kFloat: return reduce_fn<float>(op);
    case at::kDouble: return reduce_fn<double>(op);
    case at::kLong: return reduce_fn<int64_t>(op);
    case at::kInt: return reduce_fn<int32_t>(op);
    case at::kHalf: return reduce_fn<gloo::float16>(op);
    default:
      throw std::invalid_argument(std::string("same-host allreduce: unsupported dtype ") +
                                  c10::toString(type));
  }
}

// Collective over `context`: every rank's `mine` (the same length on
// every rank), concatenated in rank order.
inline std::vector<int64_t> allgather(const std::shared_ptr<gloo::Context>& context,
                                      std::vector<int64_t> mine) {
  std::vector<int64_t> all(mine.size() * context->size);
  gloo::AllgatherOptions opts(context);
  opts.setInput(mine.data(), mine.size());
  opts.setOutput(all.data(), all.size());
  gloo::allgather(opts);
  return all;
}

// False when this process opts out of the same-host paths
// (DDPRPC_GLOO_SAME_HOST=0); every rank then keeps Gloo's.
inline bool same_host_willing() {
  const char* v = std::getenv("DDPRPC_GLOO_SAME_HOST");
  return v == nullptr || std::string(v) != "0";
}

}  // namespace ddprpc::ddp::internal
