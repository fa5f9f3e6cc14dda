// What an allreduce combines elements with, as the Gloo group's algorithms
// take it.
#pragma once

#include <cstddef>

namespace ddprpc::ddp::internal {

enum class Reduction { kSum, kMin, kMax };

// out[i] = op(a[i], b[i]) for n elements; out may be a or b.
using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t n);

}  // namespace ddprpc::ddp::internal
