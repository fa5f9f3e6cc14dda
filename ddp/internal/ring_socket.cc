#include "ddp/internal/ring_socket.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "rpc/core/internal/receive_low_water.h"

namespace ddprpc::ddp::internal::ring {

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string errno_text(int e) { return std::strerror(e); }

// How long a wait that checks its deadline every kSlice may sleep: on the
// steady clock, so a step of the wall clock cannot stretch it.
std::chrono::microseconds slice_until(absl::Time deadline) {
  const absl::Duration left = std::max(absl::ZeroDuration(), std::min(deadline - absl::Now(), kSlice));
  return std::chrono::microseconds(absl::ToInt64Microseconds(left));
}

int poll_ms(absl::Time until) {
  const absl::Duration left = until - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1000));
}

void set_nonblocking(int fd, bool on) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, on ? flags | O_NONBLOCK : flags & ~O_NONBLOCK);
}

// Blocking, its calls returning every kSlice; TCP_NODELAY, so that a
// call's last partial segment does not wait for an acknowledgement.
void prepare_stream(int fd) {
  set_nonblocking(fd, false);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  timeval tv{};
  tv.tv_usec = static_cast<suseconds_t>(absl::ToInt64Microseconds(kSlice));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// What a socket call that made no progress means: "" to try again.
std::string stalled(int result, int e, absl::Time deadline, const std::atomic<bool>* cancel,
                    const std::string& peer) {
  if (result == 0) return absl::StrCat(peer, " closed its connection");
  if (e != EAGAIN && e != EWOULDBLOCK && e != EINTR) {
    return absl::StrCat("the connection with ", peer, " failed: ", errno_text(e));
  }
  if (cancel != nullptr && cancel->load()) return "cancelled";
  if (absl::Now() >= deadline) return absl::StrCat("no progress with ", peer, " before the deadline");
  return "";
}

std::string overdue(absl::Time deadline, const std::atomic<bool>* cancel, const std::string& peer) {
  if (cancel != nullptr && cancel->load()) return "cancelled";
  if (absl::Now() >= deadline) {
    return absl::StrCat("the transfer with ", peer, " did not end before the deadline");
  }
  return "";
}

// Writes n bytes on a socket prepared by prepare_stream; "" or the error.
std::string send_all(int fd, const char* p, size_t n, absl::Time deadline,
                     const std::atomic<bool>* cancel, const std::string& peer) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      // A call ends with part of the bytes when its slice passes: a peer
      // that takes a few bytes a slice must not outlast the deadline.
      if (n > 0) {
        std::string error = overdue(deadline, cancel, peer);
        if (!error.empty()) return error;
      }
      continue;
    }
    std::string error = stalled(k < 0 ? -1 : 1, errno, deadline, cancel, peer);
    if (!error.empty()) return error;
  }
  return "";
}

// Waits in poll(), every kSlice at most, for the receive low-water mark;
// reads never block, so a mark above the bytes still to come cannot
// strand a read that already took some (receive_low_water.h). Reads
// shorter than kLowWaterMinReadBytes keep the default mark of a byte.
std::string recv_some(int fd, char* p, size_t max, size_t left, absl::Time deadline,
                      const std::atomic<bool>* cancel, const std::string& peer, int* low_water,
                      size_t* got) {
  *got = 0;
  for (;;) {
    rpc::internal::expect_bytes(fd, left >= rpc::internal::kLowWaterMinReadBytes ? left : 1,
                                low_water);
    const ssize_t k = ::recv(fd, p, max, MSG_DONTWAIT);
    const int e = errno;
    if (k > 0) {
      *got = static_cast<size_t>(k);
      return "";
    }
    std::string error = stalled(static_cast<int>(k), e, deadline, cancel, peer);
    if (!error.empty()) return error;
    if (k < 0 && (e == EAGAIN || e == EWOULDBLOCK)) {
      pollfd ready{fd, POLLIN, 0};
      if (::poll(&ready, 1, poll_ms(std::min(deadline, absl::Now() + kSlice))) < 0 &&
          errno != EINTR) {
        return absl::StrCat("the connection with ", peer, " failed: ", errno_text(errno));
      }
    }
  }
}

// Reads exactly n bytes; "" or the error.
std::string recv_all(int fd, char* p, size_t n, absl::Time deadline,
                     const std::atomic<bool>* cancel, const std::string& peer, int* low_water) {
  if (low_water != nullptr) {
    while (n > 0) {
      size_t got = 0;
      std::string error = recv_some(fd, p, n, n, deadline, cancel, peer, low_water, &got);
      if (!error.empty()) return error;
      p += got;
      n -= got;
      if (n > 0) {  // as in send_all
        error = overdue(deadline, cancel, peer);
        if (!error.empty()) return error;
      }
    }
    return "";
  }
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, MSG_WAITALL);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      if (n > 0) {  // as in send_all
        std::string error = overdue(deadline, cancel, peer);
        if (!error.empty()) return error;
      }
      continue;
    }
    std::string error = stalled(static_cast<int>(k), errno, deadline, cancel, peer);
    if (!error.empty()) return error;
  }
  return "";
}

std::string rank_name(int rank) { return absl::StrCat("rank ", rank); }

Fd connect_ipv4(uint32_t ip, int port, absl::Time deadline, const std::atomic<bool>* cancel,
                std::string* error) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(ip);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  while (true) {
    Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (fd.get() < 0) {
      *error = errno_text(errno);
      return Fd();
    }
    int rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
    int e = rc == 0 ? 0 : errno;
    if (e == EINPROGRESS) {
      pollfd p{fd.get(), POLLOUT, 0};
      while (((rc = ::poll(&p, 1, poll_ms(std::min(deadline, absl::Now() + kSlice)))) < 0 &&
              errno == EINTR) ||
             (rc == 0 && absl::Now() < deadline && !cancel->load())) {
      }
      if (rc <= 0) {
        *error = "no connection before the deadline";
        return Fd();
      }
      socklen_t len = sizeof(e);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &e, &len);
    }
    if (e == 0) {
      prepare_stream(fd.get());
      return fd;
    }
    if (absl::Now() >= deadline || cancel->load() || (e != ECONNREFUSED && e != EINTR)) {
      *error = cancel->load() ? "cancelled" : errno_text(e);
      return Fd();
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

}  // namespace ddprpc::ddp::internal::ring
