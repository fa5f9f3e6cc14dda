// One end of a same-host socket (Conn): framing, a write queue that never
// blocks the sender, read-ahead, liveness through the peer's /proc entry,
// and tensors read from the peer's memory. Also what a transport's
// listeners and channels share (Settings).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/transport/internal/same_host_protocol.h"
#include "rpc/transport/transport.h"
#include "rpc/wire/codec.h"

namespace ddprpc::rpc::transport::same_host {

using rpc::internal::Frame;

// What a transport's servers and channels share: its options, and the spin
// its waits may take (set once the world is known).
struct Settings {
  explicit Settings(TransportOptions o) : options(std::move(o)) {}
  const TransportOptions options;
  std::atomic<int64_t> spin_ns{0};
};

// A frame read, written to the capture directory if there is one.
void capture(const Settings& settings, const char* kind, const Frame& frame);

// The handshake's bounds.
inline constexpr uint32_t kMaxHandshakeBody = 4096;
inline constexpr absl::Duration kHandshakeTimeout = absl::Seconds(10);

// One end of a socket: sends from any thread without blocking (what the
// socket does not take waits in a queue that the reading thread flushes),
// and reads on one thread at a time.
class Conn {
 public:
  // `on_wake`, if given, runs at every wake() besides the eventfd: for a
  // connection whose reader waits elsewhere (the server's epoll set).
  // Tensors are lent by address while the peer has not acknowledged more
  // than `max_lent_bytes` (one tensor is lent whatever its size when none
  // is); beyond, they go inline.
  Conn(int fd, pid_t peer_pid, int64_t max_message_bytes, absl::Duration keepalive_interval,
       absl::Duration keepalive_timeout, std::function<void()> on_wake = nullptr,
       int64_t max_lent_bytes = INT64_MAX);
  ~Conn();
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;

  pid_t peer_pid() const { return peer_pid_; }

  void set_may_send_remote(bool may) {
    absl::MutexLock lock(&write_mu_);
    may_send_remote_ = may;
  }

  // Queues a frame; false once the connection is shut down or broken.
  bool send_frame(const Frame& frame);

  // Sends a message without tensors.
  bool send_control(Kind kind, uint8_t flags, uint64_t seq, const std::string& body = {});

  // Whether writing found the peer's end closed.
  bool peer_closed() const {
    absl::MutexLock lock(&write_mu_);
    return peer_closed_;
  }

  // Bytes queued here, not yet taken by the socket.
  int64_t queued_bytes() const {
    absl::MutexLock lock(&write_mu_);
    return queued_bytes_;
  }

  absl::Status on_ack(uint64_t seq);

  // No more sends; wakes the reader, whose next wait fails.
  void shutdown();

  // Lets the writes queued so far go out (at most `timeout`), then shuts down.
  void shutdown_after_flush(absl::Duration timeout);

  bool broken() const {
    absl::MutexLock lock(&write_mu_);
    return broken_ || shut_;
  }

  void wake();

  // ---- reading: one thread at a time.

  // Waits until the socket has bytes (flushing the send queue and watching
  // the peer meanwhile), or `deadline`. Cancelled once shut down;
  // Unavailable when the peer's process stopped or died. With `yield`,
  // returns Aborted whenever yield() is true when it looks.
  absl::Status wait_readable(absl::Time deadline = absl::InfiniteFuture(),
                             const std::function<bool()>& yield = nullptr);

  int fd() const { return fd_; }
  int wake_fd() const { return wake_fd_; }
  void drain_wake();
  // Writes what the socket takes; true if something is left to write.
  bool flush() {
    absl::MutexLock lock(&write_mu_);
    flush_locked();
    return !out_.empty();
  }
  // The same, for a reader that polls the socket elsewhere: `want_out` says
  // whether something is left; Cancelled once shut down, Unavailable once
  // broken.
  absl::Status flush_for_reader(bool* want_out);
  // Reads what the socket holds into the read-ahead buffer (one recv that
  // does not wait) when that buffer is empty: OK with bytes buffered, or
  // with `would_block` set when the socket had none; Unavailable at the end
  // of the stream (`eof` set). After start_reading_ahead() only.
  absl::Status fill(bool* would_block, bool* eof);
  // Whether the peer's process still runs (see check_peer), for a reader
  // that waits elsewhere and has not heard from it for keepalive_interval.
  absl::Status check_peer_alive() { return check_peer(); }
  // The peer check of wait_readable, at most once per keepalive_interval,
  // for threads that poll the socket themselves.
  absl::Status check_peer_now_and_then();

  // From here on, reads take what the socket holds (up to kReadAhead
  // bytes) and keep what is not asked for yet: a small message costs one
  // recv, and messages that came together one recv for all. Called once
  // the handshake is done: nothing a peer sends before is read ahead.
  void start_reading_ahead() {
    if (!ahead_) ahead_.reset(new char[kReadAhead]);  // not zeroed: only what recv wrote is read
  }
  // Whether bytes read ahead wait: the socket's readiness does not show them.
  bool has_buffered() const { return ahead_pos_ < ahead_end_; }
  // Whether every byte read so far has been used and the last read took
  // all the socket held: bytes that come later show as readiness, so a
  // reader polling the socket need not try to read first.
  bool drained() const { return !has_buffered() && read_all_; }

  // Reads exactly n bytes; Unavailable at end of stream (eof set when no
  // byte of them came). Once a message has started (`in_message`, or a
  // byte of these came), its bytes must keep coming: a silence of
  // 6 x keepalive_timeout ends the read (Unavailable), so that a live peer
  // that stops part way does not hold its reader for good; and so does
  // `deadline` passing within a message, however the bytes trickle.
  absl::Status read_exact(void* dst, size_t n, bool* eof = nullptr,
                          absl::Time deadline = absl::InfiniteFuture(), bool in_message = false);

  // Reads n bytes into a string that grows with the bytes that came, so a
  // claim of many bytes costs resident memory only as they arrive. Its
  // capacity is reserved at once: one block, whose pages are touched only as
  // bytes are written. Grown by doubling instead, a large head left a trail
  // of freed 1..32 MiB blocks that glibc's allocator, its mmap threshold
  // raised by the first large free, kept in its heap (3 x 64 MiB resident
  // after a 64 MiB string argument).
  absl::Status read_growing(size_t n, std::string* out, absl::Time deadline);

  // Reads a kFrame's head, descriptors and tensors, checking every claim,
  // within 6 x keepalive_timeout plus its socket bytes at
  // kMinMessageBytesPerSecond.
  absl::Status read_frame(const Preamble& p, Frame* frame);

 private:
  struct Piece {
    std::string bytes;
    at::Tensor tensor;  // or the tensor's bytes
    size_t done = 0;
    const char* base() const {
      return tensor.defined() ? static_cast<const char*>(tensor.data_ptr()) : bytes.data();
    }
    size_t size() const {
      return tensor.defined() ? tensor.numel() * tensor.element_size() : bytes.size();
    }
  };

  void enqueue(std::string bytes, at::Tensor tensor) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);

  // Writes what the socket takes now; wakes the reader to wait for room
  // when something is left.
  void flush_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);

  bool shut_now() const {
    absl::MutexLock lock(&write_mu_);
    return shut_;
  }

  // Whether the peer's process still runs: gone or a zombie, or stopped
  // for keepalive_timeout, is unreachable.
  absl::Status check_peer();

  const int fd_;
  const int wake_fd_;
  const pid_t peer_pid_;  // from the kernel (SO_PEERCRED), 0 if unknown
  const int64_t max_message_bytes_;
  const int64_t max_lent_bytes_;
  const absl::Duration keepalive_interval_;
  const absl::Duration keepalive_timeout_;
  const std::function<void()> on_wake_;
  static constexpr size_t kReadAhead = 64 << 10;
  static constexpr double kMinMessageBytesPerSecond = 16 << 20;
  // The reading thread's:
  absl::Time stopped_since_ = absl::InfiniteFuture();
  absl::Time last_check_ = absl::InfinitePast();
  std::unique_ptr<char[]> ahead_;  // bytes read ahead: [ahead_pos_, ahead_end_)
  size_t ahead_pos_ = 0;
  size_t ahead_end_ = 0;
  bool read_all_ = false;  // the last read into ahead_ left the socket empty

  mutable absl::Mutex write_mu_;
  // State below is protected by write_mu_.
  std::deque<Piece> out_ ABSL_GUARDED_BY(write_mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(write_mu_) = 0;
  bool waiting_for_room_ ABSL_GUARDED_BY(write_mu_) = false;
  bool may_send_remote_ ABSL_GUARDED_BY(write_mu_) = false;
  uint64_t next_seq_ ABSL_GUARDED_BY(write_mu_) = 0;
  std::map<uint64_t, std::pair<std::vector<at::Tensor>, uint64_t>> unacked_
      ABSL_GUARDED_BY(write_mu_);
  int64_t unacked_bytes_ ABSL_GUARDED_BY(write_mu_) = 0;
  bool shut_ ABSL_GUARDED_BY(write_mu_) = false;
  bool broken_ ABSL_GUARDED_BY(write_mu_) = false;
  std::string broken_why_ ABSL_GUARDED_BY(write_mu_);
  bool peer_closed_ ABSL_GUARDED_BY(write_mu_) = false;  // broken by the peer's close
};

// Reads a message's preamble and checks its magic.
absl::Status read_preamble(Conn* conn, Preamble* p, bool* eof,
                           absl::Time deadline = absl::InfiniteFuture());

}  // namespace ddprpc::rpc::transport::same_host
