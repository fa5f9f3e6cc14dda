#include "ddp/internal/pair_auth.h"

#include <gloo/common/error.h>
#include <gloo/transport/unbound_buffer.h>
#include <openssl/crypto.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace ddprpc::ddp::internal {
namespace {

constexpr size_t kNonceBytes = 16;
// rpc::Store::sign's length (hex SHA-256).
constexpr size_t kTagBytes = 64;

std::string fresh_nonce() {
  std::random_device device;  // the kernel's random bytes
  std::string nonce(kNonceBytes, '\0');
  for (size_t i = 0; i < kNonceBytes; i += 4) {
    const uint32_t word = device();
    for (size_t k = 0; k < 4 && i + k < kNonceBytes; ++k) nonce[i + k] = static_cast<char>(word >> (8 * k));
  }
  return nonce;
}

std::string tag_message(absl::string_view scope, int from, int to, const std::string& receiver_nonce,
                        const std::string& sender_nonce) {
  return absl::StrCat("gloo-pair|", scope, "|", from, "|", to, "|",
                      absl::BytesToHexString(receiver_nonce), "|",
                      absl::BytesToHexString(sender_nonce));
}

// Sends outgoing[r] to every peer r and receives incoming[r] (`bytes` each)
// from it, on one slot; throws naming the first peer that fails.
void exchange(gloo::Context& context, std::vector<std::string>& outgoing,
              std::vector<std::string>& incoming, size_t bytes, const char* what) {
  const int rank = context.rank, size = context.size;
  const uint64_t slot = context.nextSlot();
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> sends(size), recvs(size);
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    incoming[r].assign(bytes, '\0');
    sends[r] = context.createUnboundBuffer(outgoing[r].data(), bytes);
    recvs[r] = context.createUnboundBuffer(incoming[r].data(), bytes);
    sends[r]->send(r, slot);
    recvs[r]->recv(r, slot);
  }
  // One deadline for all the peers: a peer that answers just before its
  // own wait would end must not restart the timeout of the next.
  const auto deadline = std::chrono::steady_clock::now() + context.getTimeout();
  auto left = [&deadline] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()));
  };
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    try {
      if (!recvs[r]->waitRecv(left()) || !sends[r]->waitSend(left())) {
        throw std::runtime_error("aborted");
      }
    } catch (const std::exception& e) {
      throw std::runtime_error(absl::StrCat("rank ", rank, " of ", size, " got no ", what,
                                            " from rank ", r, " over their Gloo pair: ", e.what()));
    }
  }
}

}  // namespace

void authenticate_pairs(gloo::Context& context, const Signer& sign, absl::string_view scope) {
  const int rank = context.rank, size = context.size;
  if (size < 2) return;
  // Round one: a fresh nonce to every peer (one per peer, so that a peer
  // cannot answer one pair's challenge with another's).
  std::vector<std::string> mine(size), theirs(size);
  for (int r = 0; r < size; ++r) {
    if (r != rank) mine[r] = fresh_nonce();
  }
  exchange(context, mine, theirs, kNonceBytes, "nonce");
  // Round two: each side's MAC over the peer's nonce and its own.
  std::vector<std::string> tags(size), answers(size);
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    tags[r] = sign(tag_message(scope, rank, r, theirs[r], mine[r]));
    if (tags[r].size() != kTagBytes) {
      throw std::logic_error("authenticate_pairs: the signer's MAC is not 64 hex digits");
    }
  }
  exchange(context, tags, answers, kTagBytes, "proof");
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    const std::string expected = sign(tag_message(scope, r, rank, mine[r], theirs[r]));
    // Constant time: the comparison's duration says nothing of the MAC.
    if (CRYPTO_memcmp(expected.data(), answers[r].data(), kTagBytes) != 0) {
      throw std::runtime_error(absl::StrCat(
          "rank ", rank, " of ", size, ": the Gloo pair with rank ", r,
          " is not connected to the job's worker (its proof of the job's secret is wrong)"));
    }
  }
}

}  // namespace ddprpc::ddp::internal
