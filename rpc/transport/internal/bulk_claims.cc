#include "rpc/transport/internal/bulk_claims.h"

#include "absl/strings/str_cat.h"
#include "rpc/transport/internal/bulk_wire.h"

namespace ddprpc::rpc::transport::bulk {

std::shared_ptr<ClaimTable::Claim> ClaimTable::reserve(int peer, uint64_t id, uint64_t nbytes,
                                                       uint32_t ranges) {
  absl::MutexLock lock(&mu_);
  const auto held = per_peer_.count(peer) ? per_peer_[peer] : std::pair<int, int64_t>{0, 0};
  if (closed_ || ranges == 0 || ranges > kMaxPushRanges ||
      held.first >= limits_.max_claims_per_peer ||
      nbytes > static_cast<uint64_t>(limits_.max_bytes_per_peer - held.second) ||
      claims_.count({peer, id}) != 0) {
    return nullptr;
  }
  auto claim = std::make_shared<Claim>();
  claim->peer = peer;
  claim->id = id;
  claim->nbytes = nbytes;
  claim->ranges = ranges;
  claim->started.assign(ranges, false);
  claims_[{peer, id}] = claim;
  auto& count = per_peer_[peer];
  ++count.first;
  count.second += static_cast<int64_t>(nbytes);
  return claim;
}

bool ClaimTable::ready(const std::shared_ptr<Claim>& claim, at::Tensor tensor) {
  const uint64_t nbytes = static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
  absl::MutexLock lock(&mu_);
  if (nbytes != claim->nbytes || !claim->listed) {
    erase_locked(claim);
    return false;
  }
  claim->tensor = std::move(tensor);
  claim->made = absl::Now();
  return true;
}

void ClaimTable::erase_locked(const std::shared_ptr<Claim>& claim) {
  if (!claim->listed) return;
  claim->listed = false;
  claims_.erase({claim->peer, claim->id});
  auto& count = per_peer_[claim->peer];
  count.second -= static_cast<int64_t>(claim->nbytes);
  if (--count.first == 0) per_peer_.erase(claim->peer);
}

absl::Status ClaimTable::begin_range(int peer, uint64_t id, uint64_t total, uint32_t ranges,
                                     uint32_t index, absl::Duration wait,
                                     std::shared_ptr<Claim>* out, char** dst,
                                     uint64_t* length) {
  absl::MutexLock lock(&mu_);
  auto listed = [this, peer, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closed_) return true;
    const auto it = claims_.find({peer, id});
    return it != claims_.end() && it->second->tensor.defined();
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&listed), wait)) {
    return absl::NotFoundError(absl::StrCat("no frame names pushed tensor ", id));
  }
  if (closed_) return absl::CancelledError("the transport is shutting down");
  std::shared_ptr<Claim> claim = claims_[{peer, id}];
  if (total != claim->nbytes || ranges != claim->ranges || index >= ranges) {
    claim->failed = true;
    return absl::DataLossError(absl::StrCat("range ", index, " of ", ranges, " of ", total,
                                            " bytes, where its frame says ", claim->ranges,
                                            " ranges of ", claim->nbytes, " bytes"));
  }
  if (claim->started[index]) {
    claim->failed = true;
    return absl::DataLossError(absl::StrCat("range ", index, " came twice"));
  }
  claim->started[index] = true;
  ++claim->active;
  uint64_t begin;
  range_of(total, ranges, index, &begin, length);
  *dst = static_cast<char*>(claim->tensor.data_ptr()) + begin;
  *out = std::move(claim);
  return absl::OkStatus();
}

void ClaimTable::end_range(const std::shared_ptr<Claim>& claim, bool ok) {
  absl::MutexLock lock(&mu_);
  --claim->active;
  if (ok) {
    ++claim->done;
  } else {
    claim->failed = true;
  }
}

bool ClaimTable::await(const std::shared_ptr<Claim>& claim, absl::Duration start_wait,
                       absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto settled = [&claim]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return claim->done == claim->ranges || claim->failed;
  };
  auto all_started = [&claim]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (claim->done == claim->ranges || claim->failed) return true;
    for (bool s : claim->started) {
      if (!s) return false;
    }
    return true;
  };
  bool whole = false;
  if (mu_.AwaitWithDeadline(absl::Condition(&all_started), claim->made + start_wait) &&
      mu_.AwaitWithDeadline(absl::Condition(&settled), deadline)) {
    whole = !claim->failed;
  }
  erase_locked(claim);
  if (!whole) {
    auto idle = [&claim]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return claim->active == 0; };
    mu_.Await(absl::Condition(&idle));
  }
  return whole;
}

void ClaimTable::close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

void ClaimTable::drop(const std::shared_ptr<Claim>& claim) {
  absl::MutexLock lock(&mu_);
  erase_locked(claim);
}

size_t ClaimTable::size() {
  absl::MutexLock lock(&mu_);
  return claims_.size();
}

}  // namespace ddprpc::rpc::transport::bulk
