// The rendezvous store's contents and rules, apart from gRPC: every request
// is checked against the bounds below before it touches the data, so a
// client can neither make the store hold without limit nor tie up its
// threads (waits are bounded in number and time).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include <grpcpp/support/status.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "rpc/rendezvous/store.pb.h"

namespace ddprpc::rpc::internal {

class StoreState {
 public:
  explicit StoreState(int max_waiters = kMaxWaiters) : max_waiters_(max_waiters) {}

  static constexpr size_t kMaxKeyBytes = 4096;
  static constexpr size_t kMaxValueBytes = 1 << 20;
  static constexpr int kMaxKeysPerRequest = 4096;
  static constexpr size_t kMaxKeys = 1 << 16;           // keys held
  static constexpr size_t kMaxBytes = size_t{64} << 20;  // keys and values held
  static constexpr int kMaxWaiters = 1024;               // get()/wait() blocked at once (default)
  // The keys they wait for, all together, counted as their bytes plus
  // kWaitingKeyOverhead each: a barrier of 1024 workers on 1024 keys each
  // fits, 8 requests of 4096 keys of 4 KiB do not.
  static constexpr size_t kMaxWaitingKeyBytes = size_t{128} << 20;
  static constexpr size_t kWaitingKeyOverhead = 32;
  static constexpr int64_t kMaxTimeoutMs = int64_t{24} * 3600 * 1000;
  // Largest request worth reading (gRPC refuses larger ones).
  static constexpr int kMaxRequestBytes = kMaxValueBytes + kMaxKeysPerRequest * (kMaxKeyBytes + 8);

  // Each answers `req` into `resp`; a non-OK status names what was wrong.
  // get() and wait() block until their keys exist, the request's timeout
  // passes, `cancelled()` turns true, or stop().
  grpc::Status set(const rendezvous::StoreRequest& req, rendezvous::StoreResponse* resp);
  grpc::Status get(const rendezvous::StoreRequest& req, rendezvous::StoreResponse* resp,
                   const std::function<bool()>& cancelled);
  grpc::Status add(const rendezvous::StoreRequest& req, rendezvous::StoreResponse* resp);
  grpc::Status wait(const rendezvous::StoreRequest& req, rendezvous::StoreResponse* resp,
                    const std::function<bool()>& cancelled);
  grpc::Status check(const rendezvous::StoreRequest& req, rendezvous::StoreResponse* resp);
  // Compare-and-set with c10d's Store::compareSet semantics, `req.value()`
  // being the expected value and `req.desired()` the one to store:
  //  - `key` unset and `expected` empty: stores `desired`, answers it;
  //  - `key` unset and `expected` not empty: stores nothing, answers
  //    `expected` (not what the key holds: it holds nothing);
  //  - `key` holding `expected` (an empty value matches an empty `expected`):
  //    stores `desired`, answers it;
  //  - `key` holding something else: stores nothing, answers what it holds.
  // Key and values are bounded as set()'s; a store that cannot take
  // `desired` refuses it as set() would (nothing stored). What it stores
  // wakes get() and wait() on `key` as set() does.
  grpc::Status compare_set(const rendezvous::StoreRequest& req, rendezvous::StoreResponse* resp);

  // Wakes every blocked request; later ones fail at once.
  void stop();

 private:
  // Stores `value` at `key` within the bounds.
  grpc::Status put(const std::string& key, std::string value) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks until every key exists; `keys` point into the caller's request.
  grpc::Status await_keys(const std::vector<const std::string*>& keys, int64_t timeout_ms,
                          const std::function<bool()>& cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int max_waiters_;
  absl::Mutex mu_;
  // State below is protected by mu_.
  std::map<std::string, std::string> data_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of keys and values in data_
  int waiters_ ABSL_GUARDED_BY(mu_) = 0;
  size_t waiting_key_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // the keys of the waiters
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace ddprpc::rpc::internal
