// A streaming ring allreduce over TCP connections of the group's own: the
// Gloo group's algorithm for large allreduces between hosts.
//
// Rank r holds one connection to rank r + 1 (it writes) and one from rank
// r - 1 (it reads). An allreduce of a buffer cut into `size` chunks takes
// size - 1 reduce-scatter steps and size - 1 allgather steps, as Gloo's
// ring does, but nothing waits for a step to end: a thread writes while
// the calling thread reads, and the writer sends a piece of a chunk as
// soon as the reader has reduced (or received) that piece, so the bytes
// stream around the ring with no announcement or acknowledgement per
// segment. Received bytes are reduced from a small staging buffer into the
// caller's buffer (reduce-scatter) or read straight into it (allgather).
//
// Connections are made once, in connect(), and the listening socket is
// closed as soon as the rank before has proved itself: after setup no
// port of the ring is open. A connection proves, within the setup
// timeout, that it comes from the job's worker holding rank r - 1: a MAC
// under the job's secret over a fresh nonce the listener's rank gave out
// over the group's (already authenticated) Gloo pairs, or, with no secret,
// that nonce itself. Strangers are closed; at most kMaxPendingHellos wait
// in their handshake at once, one accepted in an earlier round giving way
// to a newcomer (a silent one first).
//
// Every allreduce starts with a header (sequence number, element count,
// element size, dtype, reduction, and the RingCall: the whole allreduce this
// call is a part of, and the caller's op) that the next rank checks against
// its own call, so ranks that disagree fail with an error naming both calls
// instead of mixing buffers. Any failure (a peer that closed, silence past
// the deadline, a mismatch) fails the call on this rank, closes both
// connections so that the neighbours fail at once too, and leaves the ring
// broken: later calls throw at once.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "absl/strings/string_view.h"
#include "ddp/internal/reduction.h"

namespace ddprpc::ddp::internal {

// Every rank's `mine` (the same length on every rank), concatenated in
// rank order: a collective over the group's authenticated pairs.
using Allgather = std::function<std::vector<int64_t>(std::vector<int64_t> mine)>;

// What the ranks must agree on beyond one ring's share of an allreduce:
// an allreduce striped over several rings is `whole` elements cut into
// `parts`, this call being part `part`; `op` is the caller's own code for
// its reduction (two ops may reduce alike: an average sums).
struct RingCall {
  int64_t whole = -1;  // -1: this call's numel (not striped)
  uint32_t part = 0;
  uint32_t parts = 1;
  uint32_t op = 0;
};

class TcpRing {
 public:
  static constexpr int kMaxPendingHellos = 16;

  struct Options {
    // IPv4 address this rank listens on, the one its peers reach it at.
    std::string listen_address;
    // Bound on the whole setup.
    absl::Duration timeout = absl::Seconds(60);
    // MAC under the job's secret (rpc::Store::sign, 64 hex digits); empty
    // when the job has none.
    std::function<std::string(absl::string_view message)> sign;
    // Names the group (its store prefix): a proof for one group is refused
    // by another.
    std::string scope;
    // false: this rank does not take part, and so no rank builds a ring.
    bool enabled = true;
  };

  // Collective over `allgather`'s group. nullptr on every rank alike when
  // some rank does not take part (disabled, an address that is not an IPv4
  // literal, no listening socket), with the reason in *why. Throws
  // std::runtime_error naming the rank when a connection cannot be made or
  // proved within the timeout.
  static std::unique_ptr<TcpRing> connect(int rank, int size, const Allgather& allgather,
                                          const Options& options, std::string* why);

  ~TcpRing();
  TcpRing(const TcpRing&) = delete;
  TcpRing& operator=(const TcpRing&) = delete;

  // Collective, in place: `data` holds `numel` elements of `element_size`
  // bytes; `dtype`, `reduction` and `call` go in the header (every rank must
  // pass the same); `reduce` combines elements. Throws std::runtime_error
  // naming the rank and its neighbour on failure or past `deadline`.
  void allreduce(void* data, int64_t numel, size_t element_size, int dtype, Reduction reduction,
                 ReduceFn reduce, absl::Time deadline, RingCall call = {});

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Why an earlier allreduce broke the ring; "" while it works. Not while
  // an allreduce runs.
  const std::string& failure() const { return broken_; }

 private:
  TcpRing(int rank, int size, int to_next, int from_previous);

  // Writes the header and the send items; records its error in
  // writer_error_ (never throws).
  void write_items(const char* header, size_t header_bytes, const std::vector<int64_t>& offsets,
                   const std::vector<int64_t>& lengths, const std::vector<int64_t>& needed,
                   char* base, absl::Time deadline);
  // Ends a failed call: both connections shut down, the ring broken.
  void fail(const std::string& error);
  // Marks the call failed, shutting `fd` down and waking any wait; false
  // when the other side had failed first.
  bool first_failure(int fd);
  std::string who() const;

  const int rank_, size_;
  int to_next_ = -1;
  int from_previous_ = -1;
  int low_water_ = 1;  // from_previous_'s receive low-water mark (ring::recv_all)
  uint32_t sequence_ = 0;
  std::string broken_;  // empty while the ring works
  std::vector<char> staging_;

  // Shared by the reader (the calling thread) and the writer of one call.
  std::atomic<int64_t> received_{0};  // bytes of receive items done
  std::atomic<bool> writer_waiting_{false};
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::condition_variable progress_;  // received_, items_sent_ or failed_ changed
  int items_sent_ = 0;                // guarded by mu_: the writer's items done
  std::string writer_error_;  // written by the writer, read after join
};

}  // namespace ddprpc::ddp::internal
