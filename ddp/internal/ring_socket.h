// Socket calls of the group's TCP ring (tcp_ring.h): blocking sockets
// whose calls return every kSlice to check a deadline and a cancel flag,
// errors as text naming the peer, never SIGPIPE.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "rpc/core/internal/byte_order.h"

namespace ddprpc::ddp::internal::ring {

// Blocking socket calls return at least this often, to check the
// deadline and whether the call failed elsewhere.
constexpr absl::Duration kSlice = absl::Milliseconds(200);

// Little-endian integers on the wire.
using rpc::internal::get_u32;
using rpc::internal::get_u64;
using rpc::internal::put_u32;
using rpc::internal::put_u64;

// Owns a file descriptor.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset();

 private:
  int fd_;
};

std::string errno_text(int e);
std::string rank_name(int rank);

// How long a wait that checks its deadline every kSlice may sleep: on the
// steady clock, so a step of the wall clock cannot stretch it.
std::chrono::microseconds slice_until(absl::Time deadline);
// poll()'s timeout towards `until`, at most a second.
int poll_ms(absl::Time until);
void set_nonblocking(int fd, bool on);
// Blocking, its calls returning every kSlice; TCP_NODELAY, so that a
// call's last partial segment does not wait for an acknowledgement.
void prepare_stream(int fd);

// What a socket call that made no progress means: "" to try again.
// `result` is the call's return (0: the peer closed), `e` its errno.
std::string stalled(int result, int e, absl::Time deadline, const std::atomic<bool>* cancel,
                    const std::string& peer);
// After a socket call that made progress: "" to go on, else why not
// (`cancel` set, or the deadline passed).
std::string overdue(absl::Time deadline, const std::atomic<bool>* cancel, const std::string& peer);
// Writes or reads exactly n bytes on a socket prepared by prepare_stream;
// "" or the error. `cancel` (may be null) set elsewhere ends them, and so
// does the deadline, whether or not the peer still moves bytes.
std::string send_all(int fd, const char* p, size_t n, absl::Time deadline,
                     const std::atomic<bool>* cancel, const std::string& peer);
// With `low_water` (the socket's receive low-water mark as last set,
// rpc/core/internal/receive_low_water.h), recv_all waits in poll() until
// the kernel holds min(what is left, the mark's size) bytes, instead of
// blocking in recv() and being woken for every segment; with less than
// kLowWaterMinReadBytes left, any byte wakes it.
std::string recv_all(int fd, char* p, size_t n, absl::Time deadline,
                     const std::atomic<bool>* cancel, const std::string& peer,
                     int* low_water = nullptr);
// Waits as recv_all does with `low_water` for `left` more bytes (at
// least 1) to come, then reads what is there, at most `max`, into p; ""
// with *got > 0, or the error.
std::string recv_some(int fd, char* p, size_t max, size_t left, absl::Time deadline,
                      const std::atomic<bool>* cancel, const std::string& peer, int* low_water,
                      size_t* got);

// Connects to ip:port (host byte order) before the deadline or `cancel`;
// the socket is prepared by prepare_stream. An empty Fd and *error on
// failure.
Fd connect_ipv4(uint32_t ip, int port, absl::Time deadline, const std::atomic<bool>* cancel,
                std::string* error);

}  // namespace ddprpc::ddp::internal::ring
