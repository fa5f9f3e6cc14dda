// The bulk path's messages and the socket calls both of its ends use
// (bulk_transport.h describes the path).
//
// A connection is opened by the worker that pulls (the puller) to the
// listener of the worker that lent (the lender):
//
//   puller -> lender  hello: "DDB1", u32 from, u32 to, u32 proof size, proof
//   lender -> puller  "OK.." once the proof is checked (else it closes)
//   puller -> lender  pull:  u64 lend id, u64 offset, u64 length
//   lender -> puller  reply: u32 status, u32 0, u64 length, then the bytes
//   puller -> lender  release: u64 lend id, u64 kReleaseOffset, u64 0 (once
//                     every range of the lend has arrived; no reply)
//
// A lender may also push a lent tensor's bytes as it lends it, over
// connections it opens to the receiver's listener:
//
//   lender -> receiver  hello: "DDP1", u32 from, u32 to, u32 proof size, proof
//   receiver -> lender  "OK.." once the proof is checked (else it closes)
//   lender -> receiver  push: u64 lend id, u64 total bytes, u32 range,
//                       u32 ranges, then the range's bytes (range_of)
//
// Nothing else goes back on a push connection: the receiver takes the
// bytes for a frame that names them (TensorMeta.pushed), or closes the
// connection, and releases the lend as after a pull.
//
// Integers are little-endian. A status other than kPullOk ends the
// connection after its reply; so does any malformed message.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "rpc/core/internal/byte_order.h"

namespace ddprpc::rpc::transport::bulk {

inline constexpr char kHelloMagic[4] = {'D', 'D', 'B', '1'};
inline constexpr char kPushHelloMagic[4] = {'D', 'D', 'P', '1'};
inline constexpr char kHelloAck[4] = {'O', 'K', '.', '.'};
inline constexpr size_t kHelloFixedBytes = 16;
inline constexpr uint32_t kMaxProofBytes = 256;
inline constexpr size_t kPullBytes = 24;
inline constexpr size_t kReplyHeadBytes = 16;
inline constexpr size_t kPushHeadBytes = 24;
// Connections one tensor may be pushed over.
inline constexpr uint32_t kMaxPushRanges = 16;

inline constexpr uint64_t kReleaseOffset = ~uint64_t{0};

enum PullStatus : uint32_t {
  kPullOk = 0,
  kPullUnknownLend = 1,  // no such lend to this puller (never made, pulled or expired)
  kPullOutOfRange = 2,   // past the end of the lend
};

using rpc::internal::get_u32;
using rpc::internal::get_u64;
using rpc::internal::put_u32;
using rpc::internal::put_u64;

// Range `index` of `ranges` of a tensor of `total` bytes: [*begin, *begin +
// *length). Ranges are equal but for the last, and 4 KiB aligned; a pull
// and a push cut a tensor alike.
inline void range_of(uint64_t total, uint64_t ranges, uint64_t index, uint64_t* begin,
                     uint64_t* length) {
  uint64_t step = (total + ranges - 1) / ranges;
  step = (step + 4095) / 4096 * 4096;
  *begin = std::min(total, index * step);
  *length = std::min(total, *begin + step) - *begin;
}

// However slowly bytes still come, a transfer of `bytes` begun at `start`
// fails after `silence` plus the bytes at `bytes_per_second`.
inline constexpr double kMinBytesPerSecond = 16 << 20;
inline absl::Time transfer_deadline(absl::Time start, absl::Duration silence, uint64_t bytes,
                                    double bytes_per_second = kMinBytesPerSecond) {
  return start + silence +
         absl::Seconds(static_cast<double>(bytes) / std::max(1.0, bytes_per_second));
}

// Cuts short, at once and for good, every wait of the calls below that
// were given it: a connect, or a handshake, in progress when its owner
// shuts down. Thread-safe.
class Interrupt {
 public:
  Interrupt();  // without an eventfd, waits look at it every 100 ms
  ~Interrupt();
  Interrupt(const Interrupt&) = delete;
  Interrupt& operator=(const Interrupt&) = delete;

  void fire();
  bool fired() const;
  int fd() const { return fd_; }  // readable once fired; -1 without one

 private:
  const int fd_;
  std::atomic<bool> fired_{false};
};

// Blocking I/O on a socket, each call bounded by `silence`: no progress
// for that long is an error (DEADLINE_EXCEEDED), and so is `deadline`
// passing, however slowly bytes still come. The peer's end is
// UNAVAILABLE; `interrupt` firing, CANCELLED. Never raises SIGPIPE.
absl::Status write_all(int fd, const void* data, size_t n, absl::Duration silence,
                       absl::Time deadline = absl::InfiniteFuture(),
                       const Interrupt* interrupt = nullptr);
absl::Status read_exact(int fd, void* data, size_t n, absl::Duration silence,
                        absl::Time deadline = absl::InfiniteFuture(),
                        const Interrupt* interrupt = nullptr);

// The same on a blocking socket whose SO_SNDTIMEO / SO_RCVTIMEO bound
// the silence (set_silence): the bulk bytes themselves. A write, and a
// read shorter than internal::kLowWaterMinReadBytes, sleep in the kernel
// until all has moved. A longer read waits in poll() for the socket's
// receive low-water mark (rpc/core/internal/receive_low_water.h), woken
// once per half megabyte rather than once per segment, and fails only
// after a silence period in which no byte came; the mark is back at its
// default when it returns.
// Past `deadline` (checked at least once per silence period) they fail
// too, however slowly bytes still come.
absl::Status write_all_blocking(int fd, const void* data, size_t n,
                                absl::Time deadline = absl::InfiniteFuture());
absl::Status read_exact_blocking(int fd, void* data, size_t n,
                                 absl::Time deadline = absl::InfiniteFuture());
// Makes `fd` blocking, its sends and receives failing after `silence`
// without progress.
void set_silence(int fd, absl::Duration silence);
// TCP keepalive: a connection whose peer vanished (a partition, a host
// that died) ends within about 20 s even while nobody uses it.
void set_keepalive(int fd);

// Connects to "host:port" (numeric host or name) within `timeout`, or
// until `interrupt` fires (a name's resolution is not cut short); the
// socket has TCP_NODELAY. -1 and `*error` on failure.
int connect_to(const std::string& endpoint, absl::Duration timeout, std::string* error,
               const Interrupt* interrupt = nullptr);

// Connects to `endpoint` and proves worker `from` there: a hello with
// `magic` (kHelloMagic to pull, kPushHelloMagic to push) from `from` to
// `to`, its proof for `transport` ("bulk", "bulk-push") under `token` (none
// when empty), then the listener's acknowledgement, each step within
// `connect_timeout`; the socket then blocks, failing after `silence`
// without progress (set_silence). -1 and `*error` on failure, a proof that
// cannot be made included, and at once when `interrupt` fires.
int connect_proven(const std::string& endpoint, const char (&magic)[4], const char* transport,
                   int from, int to, const std::string& token, absl::Duration connect_timeout,
                   absl::Duration silence, std::string* error,
                   const Interrupt* interrupt = nullptr);

// Listens on host:0 (an IPv6 host with or without brackets); -1 and
// `*error` on failure. `*port` is the port.
int listen_on(const std::string& host, int* port, std::string* error);

}  // namespace ddprpc::rpc::transport::bulk
