// Categorical sampling from a row of probabilities without tensor ops: what
// torch.distributions.Categorical(probs).sample() computes (inverse CDF),
// for callers that sample one action per request and cannot afford the
// dispatch of at::multinomial (about 10 us per call here).
#pragma once

#include <cstdint>
#include <random>

namespace ddprpc::models {

// The index i where the running sum of `probs[0..n)` first exceeds
// `u * sum(probs)`, for u in [0, 1). Probabilities need not be normalized;
// zero entries are never chosen unless all are zero (then n - 1).
int64_t categorical_index(const float* probs, int64_t n, double u);

// Draws from `probs` with `rng`.
template <typename Rng>
int64_t sample_categorical(const float* probs, int64_t n, Rng& rng) {
  return categorical_index(probs, n, std::uniform_real_distribution<double>(0.0, 1.0)(rng));
}

}  // namespace ddprpc::models
