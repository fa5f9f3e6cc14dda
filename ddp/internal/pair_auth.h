// Membership proofs over a Gloo context's pairs.
//
// Gloo's TCP listener hands a pair the first connection that names the
// pair's sequence number, a small integer, and never asks who connected. A
// local process that connects first, while a group is being set up, would
// take a rank's place in that pair. authenticate_pairs closes that: before
// the group uses its pairs, every two ranks exchange fresh nonces over their
// pair and then a MAC, under the job's secret, of both nonces and of who
// speaks to whom. A pair whose other end is not the job's worker fails the
// group's setup with an error naming both ranks.
#pragma once

#include <gloo/context.h>

#include <functional>
#include <string>
#include "absl/strings/string_view.h"

namespace ddprpc::ddp::internal {

// MAC of a message under the job's secret (rpc::Store::sign); all ranks of
// a group must use the same secret.
using Signer = std::function<std::string(absl::string_view message)>;

// Runs the exchange with every peer of `context` (connected, pairs in their
// default asynchronous mode), within context.getTimeout(). `scope` names the
// context (its store prefix), so a proof made for one context is refused by
// another. Throws std::runtime_error naming this rank and the peer whose
// proof was wrong, missing or late.
void authenticate_pairs(gloo::Context& context, const Signer& sign, absl::string_view scope);

}  // namespace ddprpc::ddp::internal
