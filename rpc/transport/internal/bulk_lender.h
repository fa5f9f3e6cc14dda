// The lending side of the bulk path: the table of tensors lent to peers,
// and the listener whose connections serve pulls from it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/core/internal/auth.h"
#include "rpc/transport/internal/bulk_claims.h"

namespace ddprpc::rpc::transport::bulk {

// The first of `nbytes` lent bytes at byte `first` of `storage` (the
// storage a tensor had when lent), unless the storage has shrunk below them
// since.
absl::StatusOr<const char*> lent_data(const c10::Storage& storage, uint64_t first,
                                      uint64_t nbytes);

// Tensors lent to peers, by (peer, id). What one peer holds is bounded in
// bytes, for requests and for replies apart: a lend beyond it is refused
// (the tensor then travels in its frame, where the transport's own bounds
// apply: a caller that reads no replies has its stream paused). A lend ends when its puller releases it (it has every byte),
// when the request that carried it is answered (release_request), or when it
// expires.
// Thread-safe.
class LendTable {
 public:
  // Bounds per peer: bytes of requests' tensors, and of replies'.
  LendTable(int64_t max_request_bytes_per_peer, int64_t max_reply_bytes_per_peer,
            absl::Duration timeout)
      : max_bytes_{max_request_bytes_per_peer, max_reply_bytes_per_peer}, timeout_(timeout) {}

  // The id of `tensor` (contiguous, CPU) lent to `peer` for frame
  // `frame_id` (a reply's, or a request's); 0 when the peer's bound would
  // be passed. It expires after the table's timeout, or at `not_before`
  // if that is later (a request's call deadline: the peer may read the
  // frame late, when its reading was paused).
  // `channel` (non-zero) names the channel a request went out on, for
  // release_channel().
  uint64_t lend(int peer, uint64_t frame_id, const at::Tensor& tensor, bool reply,
                absl::Time not_before = absl::InfinitePast(), uint64_t channel = 0);
  // What a pull of a lend reads: the bytes of the storage the tensor had
  // when it was lent (the program may have pointed its tensor elsewhere
  // since), kept alive with the tensor as long as this is held.
  struct LentBytes {
    at::Tensor tensor;
    c10::Storage storage;
    const char* data = nullptr;  // the lend's first byte
  };
  // Lend `id` to `peer` if [offset, offset + length) lies within it; the
  // status says which rule a pull broke.
  absl::StatusOr<LentBytes> find(int peer, uint64_t id, uint64_t offset, uint64_t length);
  // Ends lend `id` to `peer`, if there is one.
  void release(int peer, uint64_t id);
  // Ends the lends of request `frame_id` to `peer` (its reply came, or it
  // was never sent). Replies' lends are left: ids of the two directions'
  // frames come from different workers and may be equal.
  void release_request(int peer, uint64_t frame_id);
  // Ends the lends of every request to `peer` sent on `channel`: it
  // closed, so their calls have failed and no reply will release them.
  void release_channel(int peer, uint64_t channel);
  // Ends the lends past their time (lend() and find() do it too; the
  // listener calls it each second so that an idle worker lets them go).
  void expire();
  // Bytes lent to `peer` (requests' and replies'), and lends in all.
  int64_t lent_bytes(int peer);
  size_t size();

 private:
  struct Lend {
    at::Tensor tensor;
    c10::Storage storage;  // the tensor's when lent
    uint64_t begin = 0;    // of the tensor's bytes in `storage`
    uint64_t nbytes = 0;
    uint64_t frame_id = 0;
    bool reply = false;
    absl::Time expires;
    uint64_t channel = 0;
  };
  void expire_locked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void erase_locked(int peer, uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t max_bytes_[2];  // requests, replies
  const absl::Duration timeout_;
  // Request lends held; read without mu_ so that a reply to a request that
  // lent nothing takes no lock.
  std::atomic<int64_t> request_lends_{0};
  absl::Mutex mu_;
  // State below is protected by mu_.
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::pair<int, uint64_t>, Lend> lends_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<absl::Time, std::pair<int, uint64_t>>> by_time_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::pair<int, bool>, int64_t> bytes_ ABSL_GUARDED_BY(mu_);  // (peer, reply)
};

struct ListenerLimits {
  int self = -1;        // pullers' proofs must name this worker
  int world_size = 1;   // pullers name a worker in [0, world_size)
  std::string token;    // empty: connections are not authenticated
  int max_unauthenticated_connections = 64;  // beyond it the oldest give way
  absl::Duration handshake_timeout = absl::Seconds(10);
  int max_connections_per_peer = 12;  // proven connections of one worker; the oldest give way
  absl::Duration silence = absl::Seconds(30);  // a pull that stalls this long ends
};

// Serves pulls of `table`'s lends on host:0, a thread per connection, and
// takes pushes to this worker into `claims` (null: push connections are
// refused). A push waits up to the silence limit for the frame that claims
// it; one that is not claimed then, or does not match its claim, ends its
// connection.
class Listener {
 public:
  // nullptr and `*error` if it cannot listen.
  static std::unique_ptr<Listener> start(const std::string& host, const ListenerLimits& limits,
                                         std::shared_ptr<LendTable> table,
                                         std::shared_ptr<ClaimTable> claims, std::string* error);
  ~Listener();  // shutdown()
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  int port() const { return port_; }
  // Ends every connection and joins the threads. Idempotent.
  void shutdown();
  // Connections open now, proven or not (for tests).
  int connections();

 private:
  struct Connection {
    int fd = -1;
    int peer = -1;  // once proven
    absl::Time opened;
    std::atomic<bool> proven{false};
    std::atomic<bool> done{false};
    bool evicted = false;  // pushed out for a newer connection (under mu_)
    bool push = false;     // opened to push, once proven
    std::thread thread;
  };
  Listener(int fd, int wake_fd, int port, const ListenerLimits& limits,
           std::shared_ptr<LendTable> table, std::shared_ptr<ClaimTable> claims);
  void accept_loop();
  void serve(Connection* c);
  void serve_pushes(Connection* c, int peer);
  // Checks the hello; the peer's id, or -1 (and logs why).
  int handshake(Connection* c);
  void reap_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int listen_fd_;
  const int wake_fd_;  // eventfd: ends the accept loop
  const int port_;
  const ListenerLimits limits_;
  const std::shared_ptr<LendTable> table_;
  const std::shared_ptr<ClaimTable> claims_;
  const std::unique_ptr<rpc::internal::AuthChecker> auth_;
  absl::Mutex mu_;
  // State below is protected by mu_.
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::list<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  std::thread acceptor_;  // last: starts once the state above exists
};

}  // namespace ddprpc::rpc::transport::bulk
