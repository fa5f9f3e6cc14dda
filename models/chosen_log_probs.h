// log(probs[r][actions[r]]) for every row r of a [rows, n] probability
// matrix, as ONE autograd node: what Categorical(probs).log_prob(actions)
// gives for a batch, without gather, log and a transpose (three ops, each
// recorded by autograd) per batch. Backward gives probs the gradient
// gather + log would: g[r] / probs[r][actions[r]] at the chosen entries,
// zero elsewhere.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ddprpc::models {

// Returns a [rows] tensor. Throws std::invalid_argument unless probs is
// 2-D with one action per row, each in [0, n). A probs that is not a
// contiguous float CPU matrix goes through gather and log (same result).
at::Tensor chosen_log_probs(const at::Tensor& probs, const std::vector<int64_t>& actions);

}  // namespace ddprpc::models
