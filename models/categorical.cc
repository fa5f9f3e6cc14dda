#include "models/categorical.h"

namespace ddprpc::models {

int64_t categorical_index(const float* probs, int64_t n, double u) {
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += probs[i];
  const double target = u * total;
  double cdf = 0.0;
  int64_t last_nonzero = n - 1;
  for (int64_t i = 0; i < n; ++i) {
    if (probs[i] <= 0.0f) continue;
    last_nonzero = i;
    cdf += probs[i];
    if (target < cdf) return i;
  }
  return last_nonzero;  // rounding left target at the very top
}

}  // namespace ddprpc::models
