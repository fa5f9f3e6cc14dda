#include "ddp/internal/same_host_common.h"

#include <cstring>

namespace ddprpc::ddp::internal {
namespace {

// out[i] = a[i] + b[i], a vector of 32 bytes per step (one AVX or two SSE
// operations, as the clone below allows), then the tail one by one. Each
// step loads before it stores, so out may be a or b. An IEEE add is the same
// in any lane width: results are bit for bit those of a scalar loop.
typedef float FloatVec __attribute__((vector_size(32)));
typedef double DoubleVec __attribute__((vector_size(32)));

template <typename T, typename Vec>
__attribute__((always_inline)) inline void add_loop(void* out_, const void* a_, const void* b_,
                                                    size_t n) {
  constexpr size_t kLanes = sizeof(Vec) / sizeof(T);
  auto* out = static_cast<T*>(out_);
  const auto* a = static_cast<const T*>(a_);
  const auto* b = static_cast<const T*>(b_);
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Vec x, y;
    std::memcpy(&x, a + i, sizeof(Vec));
    std::memcpy(&y, b + i, sizeof(Vec));
    x += y;
    std::memcpy(out + i, &x, sizeof(Vec));
  }
  for (; i < n; ++i) out[i] = a[i] + b[i];
}

}  // namespace

__attribute__((target_clones("arch=x86-64-v3", "default"))) void sum_float(void* out, const void* a,
                                                                         const void* b, size_t n) {
  add_loop<float, FloatVec>(out, a, b, n);
}

__attribute__((target_clones("arch=x86-64-v3", "default"))) void sum_double(void* out, const void* a,
                                                                          const void* b, size_t n) {
  add_loop<double, DoubleVec>(out, a, b, n);
}

}  // namespace ddprpc::ddp::internal
