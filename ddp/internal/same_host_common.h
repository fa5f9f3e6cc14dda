// The element loops of the Gloo group's reductions, and two steps of the
// same-host allreduces' setup over the group.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
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

#include "ddp/internal/reduction.h"

namespace ddprpc::ddp::internal {

// The element loops run on the calling thread: ATen's kernels would start
// an intra-op team per piece, and with several ranks on few cores its
// spinning threads cost more than the reduction. Gloo's own loops
// (gloo/math.h) serve every dtype but the 16-bit floats: built without AVX,
// they assign through gloo::float16's operator=, which skips the store when
// the new bits equal the half encoding of the old bits read as an integer
// (its operator!= compares with rhs.x), so some results keep the
// destination's previous value. Half and bfloat16 go through c10::Half and
// c10::BFloat16, reduced in float. bool goes as bytes of 0 or 1 (uint8_t):
// its min is a logical and, its max a logical or, and the group reduces a
// bool sum as a max.

// Sums of float and double in vector steps (Gloo's loops compile to one
// scalar add per element here); the same results as gloo::sum.
void sum_float(void* out, const void* a, const void* b, size_t n);
void sum_double(void* out, const void* a, const void* b, size_t n);

// The element type a 16-bit float is reduced as: gloo::float16 (the type
// Gloo's templates are instantiated with for half) is stored as c10::Half.
template <typename T>
using Storage16 = std::conditional_t<std::is_same_v<T, gloo::float16>, c10::Half, T>;

template <typename T>
inline constexpr bool kIsFloat16 =
    std::is_same_v<T, gloo::float16> || std::is_same_v<T, c10::BFloat16>;

template <typename S, typename Op>
void float16_loop(void* out, const void* a, const void* b, size_t n) {
  static_assert(sizeof(S) == 2);
  auto* o = static_cast<S*>(out);
  const auto* x = static_cast<const S*>(a);
  const auto* y = static_cast<const S*>(b);
  for (size_t i = 0; i < n; ++i) {
    o[i] = S(Op()(static_cast<float>(x[i]), static_cast<float>(y[i])));
  }
}
struct FloatSum {
  float operator()(float a, float b) const { return a + b; }
};
struct FloatMin {
  float operator()(float a, float b) const { return b < a ? b : a; }
};
struct FloatMax {
  float operator()(float a, float b) const { return a < b ? b : a; }
};

// In place, as gloo::ReductionFunction takes them: x[i] = op(x[i], y[i]).
template <typename T, typename Op>
void float16_in_place(T* x, const T* y, size_t n) {
  float16_loop<Storage16<T>, Op>(x, x, y, n);
}

template <typename T>
ReduceFn reduce_fn(Reduction op) {
  if constexpr (kIsFloat16<T>) {
    using S = Storage16<T>;
    if (op == Reduction::kMin) return &float16_loop<S, FloatMin>;
    if (op == Reduction::kMax) return &float16_loop<S, FloatMax>;
    return &float16_loop<S, FloatSum>;
  } else {
    if (op == Reduction::kMin) return &gloo::min<T>;
    if (op == Reduction::kMax) return &gloo::max<T>;
    if constexpr (std::is_same_v<T, float>) return &sum_float;
    if constexpr (std::is_same_v<T, double>) return &sum_double;
    return &gloo::sum<T>;
  }
}

// The reduction Gloo's bound algorithms (gloo::AllreduceHalvingDoubling)
// apply, with the loops above for the 16-bit floats.
template <typename T>
const gloo::ReductionFunction<T>* reduction_function(Reduction op) {
  if constexpr (kIsFloat16<T>) {
    static const auto* sum =
        new gloo::ReductionFunction<T>(gloo::SUM, &float16_in_place<T, FloatSum>);
    static const auto* min =
        new gloo::ReductionFunction<T>(gloo::MIN, &float16_in_place<T, FloatMin>);
    static const auto* max =
        new gloo::ReductionFunction<T>(gloo::MAX, &float16_in_place<T, FloatMax>);
    return op == Reduction::kMin ? min : op == Reduction::kMax ? max : sum;
  } else {
    return op == Reduction::kMin   ? gloo::ReductionFunction<T>::min
           : op == Reduction::kMax ? gloo::ReductionFunction<T>::max
                                   : gloo::ReductionFunction<T>::sum;
  }
}

// Calls f with a value of the element type Gloo's templates take for the
// dtype of `type`; throws std::invalid_argument naming `who` and the dtype
// for any other (complex, quantized, float8, ...).
template <typename F>
decltype(auto) dispatch_dtype(at::ScalarType type, const char* who, F&& f) {
  switch (type) {
    case at::kFloat: return f(float{});
    case at::kDouble: return f(double{});
    case at::kLong: return f(int64_t{});
    case at::kInt: return f(int32_t{});
    case at::kHalf: return f(gloo::float16{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kBool:  // bytes of 0 or 1
    case at::kByte: return f(uint8_t{});
    case at::kChar: return f(int8_t{});
    default:
      throw std::invalid_argument(std::string(who) + ": unsupported dtype " +
                                  c10::toString(type));
  }
}

// Throws std::invalid_argument for a dtype dispatch_dtype does not take.
inline ReduceFn reduce_fn(at::ScalarType type, Reduction op) {
  return dispatch_dtype(type, "same-host allreduce",
                        [op](auto zero) { return reduce_fn<decltype(zero)>(op); });
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

}  // namespace ddprpc::ddp::internal
