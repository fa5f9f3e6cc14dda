#include "rpc/transport/internal/bulk_wire.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "rpc/core/internal/auth.h"
#include "rpc/core/internal/receive_low_water.h"

namespace ddprpc::rpc::transport::bulk {

namespace {

int poll_ms(absl::Duration d) {
  if (d == absl::InfiniteDuration()) return -1;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(d) + 1, 1 << 30));
}

absl::Status interrupted() { return absl::CancelledError("interrupted: shutting down"); }

// Waits until `fd` is ready for `events`; an error after `silence`, or
// once `interrupt` fires.
absl::Status wait_ready(int fd, short events, absl::Duration silence,
                        const Interrupt* interrupt) {
  pollfd p[2] = {{fd, events, 0}, {interrupt ? interrupt->fd() : -1, POLLIN, 0}};
  // An interrupt without an eventfd is looked at every 100 ms.
  const bool look = interrupt != nullptr && interrupt->fd() < 0;
  const absl::Time until = absl::Now() + silence;
  for (;;) {
    if (interrupt && interrupt->fired()) return interrupted();
    const absl::Duration left = until - absl::Now();
    const int n = ::poll(p, 2, poll_ms(look ? std::min(left, absl::Milliseconds(100)) : left));
    if (n > 0 && p[1].revents != 0) return interrupted();
    if (n > 0) return absl::OkStatus();
    if (n == 0 && (!look || absl::Now() >= until)) {
      return absl::DeadlineExceededError(
          absl::StrCat("no progress for ", absl::FormatDuration(silence)));
    }
    if (n == 0) continue;
    if (errno != EINTR) return absl::UnavailableError(absl::StrCat("poll: ", strerror(errno)));
  }
}

}  // namespace

namespace {

// Moves `n` bytes through `fd`, sending (`out`) or receiving. Polled: each
// call takes what the socket holds and polls for more, at most `silence`
// apart. Blocking: each call sleeps in the kernel until all has moved or
// the socket's own timeout passes (set_silence). Either way `deadline`
// is looked at between calls.
absl::Status transfer(int fd, char* p, size_t n, bool out, bool blocking, absl::Duration silence,
                      absl::Time deadline, const Interrupt* interrupt = nullptr) {
  const int flags = out ? (MSG_NOSIGNAL | (blocking ? 0 : MSG_DONTWAIT))
                        : (blocking ? MSG_WAITALL : MSG_DONTWAIT);
  while (n > 0) {
    if (absl::Now() > deadline) return absl::DeadlineExceededError("the transfer took too long");
    const ssize_t done = out ? ::send(fd, p, n, flags) : ::recv(fd, p, n, flags);
    if (done > 0) {
      p += done;
      n -= static_cast<size_t>(done);
      continue;
    }
    if (done == 0 && !out) return absl::UnavailableError("the connection was closed by the peer");
    if (done < 0 && errno == EINTR) continue;
    if (done < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (blocking) return absl::DeadlineExceededError("no progress for the silence limit");
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError("the transfer took too long");
      }
      absl::Status ready =
          wait_ready(fd, out ? POLLOUT : POLLIN, std::min(silence, left), interrupt);
      if (!ready.ok()) return ready;
      continue;
    }
    return absl::UnavailableError(absl::StrCat(out ? "send: " : "recv: ", strerror(errno)));
  }
  return absl::OkStatus();
}

// Reads n bytes from a blocking socket, each wait in poll() until the
// kernel holds min(what is left, the low-water mark) bytes; each read
// takes what is there without blocking. The silence is the socket's own
// receive timeout (set_silence).
absl::Status read_at_low_water(int fd, char* p, size_t n, absl::Time deadline) {
  absl::Duration silence = absl::InfiniteDuration();
  timeval limit{};
  socklen_t limit_size = sizeof(limit);
  if (::getsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, &limit_size) == 0 &&
      (limit.tv_sec != 0 || limit.tv_usec != 0)) {
    silence = absl::DurationFromTimeval(limit);
  }
  int mark = 1;
  // A wait that ran out looks once more: bytes below the mark are still
  // progress, and only a silence without any fails the read.
  bool waited_out = false;
  absl::Status ok;
  while (ok.ok() && n > 0) {
    const absl::Duration left = deadline - absl::Now();
    if (left < absl::ZeroDuration()) {
      ok = absl::DeadlineExceededError("the transfer took too long");
      break;
    }
    internal::expect_bytes(fd, n, &mark);
    const ssize_t done = ::recv(fd, p, n, MSG_DONTWAIT);
    const int e = errno;
    if (done > 0) {
      p += done;
      n -= static_cast<size_t>(done);
      waited_out = false;
    } else if (done == 0) {
      ok = absl::UnavailableError("the connection was closed by the peer");
    } else if (e == EAGAIN || e == EWOULDBLOCK) {
      if (waited_out) {
        ok = absl::DeadlineExceededError("no progress for the silence limit");
        break;
      }
      pollfd ready{fd, POLLIN, 0};
      const int r = ::poll(&ready, 1, poll_ms(std::min(silence, left)));
      if (r == 0 && silence <= left) {
        waited_out = true;
      } else if (r < 0 && errno != EINTR) {
        ok = absl::UnavailableError(absl::StrCat("poll: ", strerror(errno)));
      }
    } else if (e != EINTR) {
      ok = absl::UnavailableError(absl::StrCat("recv: ", strerror(e)));
    }
  }
  internal::reset_low_water(fd, &mark);
  return ok;
}

}  // namespace

Interrupt::Interrupt() : fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

Interrupt::~Interrupt() {
  if (fd_ >= 0) ::close(fd_);
}

void Interrupt::fire() {
  fired_.store(true, std::memory_order_release);
  if (fd_ >= 0) (void)!::eventfd_write(fd_, 1);
}

bool Interrupt::fired() const { return fired_.load(std::memory_order_acquire); }

absl::Status write_all(int fd, const void* data, size_t n, absl::Duration silence,
                       absl::Time deadline, const Interrupt* interrupt) {
  return transfer(fd, const_cast<char*>(static_cast<const char*>(data)), n, /*out=*/true,
                  /*blocking=*/false, silence, deadline, interrupt);
}

absl::Status read_exact(int fd, void* data, size_t n, absl::Duration silence,
                        absl::Time deadline, const Interrupt* interrupt) {
  return transfer(fd, static_cast<char*>(data), n, /*out=*/false, /*blocking=*/false, silence,
                  deadline, interrupt);
}

absl::Status write_all_blocking(int fd, const void* data, size_t n, absl::Time deadline) {
  return transfer(fd, const_cast<char*>(static_cast<const char*>(data)), n, /*out=*/true,
                  /*blocking=*/true, absl::ZeroDuration(), deadline);
}

absl::Status read_exact_blocking(int fd, void* data, size_t n, absl::Time deadline) {
  if (n >= internal::kLowWaterMinReadBytes) {
    return read_at_low_water(fd, static_cast<char*>(data), n, deadline);
  }
  return transfer(fd, static_cast<char*>(data), n, /*out=*/false, /*blocking=*/true,
                  absl::ZeroDuration(), deadline);
}

void set_silence(int fd, absl::Duration silence) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  timeval limit = absl::ToTimeval(silence);
  if (silence == absl::InfiniteDuration()) limit = timeval{0, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
}

void set_keepalive(int fd) {
  int on = 1, idle = 10, interval = 2, count = 3;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
}

namespace {

bool split_endpoint(const std::string& endpoint, std::string* host, std::string* port) {
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == endpoint.size()) return false;
  *host = endpoint.substr(0, colon);
  *port = endpoint.substr(colon + 1);
  if (host->size() > 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  int value;
  return absl::SimpleAtoi(*port, &value) && value > 0 && value < 65536;
}

}  // namespace

int connect_to(const std::string& endpoint, absl::Duration timeout, std::string* error,
               const Interrupt* interrupt) {
  if (interrupt && interrupt->fired()) {
    *error = absl::StrCat("did not connect to ", endpoint, ": shutting down");
    return -1;
  }
  std::string host, port;
  if (!split_endpoint(endpoint, &host, &port)) {
    *error = absl::StrCat("malformed bulk endpoint '", endpoint, "'");
    return -1;
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    *error = absl::StrCat("cannot resolve ", endpoint, ": ", gai_strerror(rc));
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      absl::Status ready = wait_ready(fd, POLLOUT, timeout, interrupt);
      int so_error = 0;
      socklen_t len = sizeof(so_error);
      if (ready.ok() && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) == 0 &&
          so_error == 0) {
        rc = 0;
      } else if (absl::IsCancelled(ready)) {
        *error = absl::StrCat("did not connect to ", endpoint, ": shutting down");
        ::close(fd);
        fd = -1;
        break;
      } else {
        errno = ready.ok() ? so_error : ETIMEDOUT;
      }
    }
    if (rc != 0) {
      *error = absl::StrCat("cannot connect to ", endpoint, ": ", strerror(errno));
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd >= 0) {
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    set_keepalive(fd);
  }
  return fd;
}

int connect_proven(const std::string& endpoint, const char (&magic)[4], const char* transport,
                   int from, int to, const std::string& token, absl::Duration connect_timeout,
                   absl::Duration silence, std::string* error, const Interrupt* interrupt) {
  const int fd = connect_to(endpoint, connect_timeout, error, interrupt);
  if (fd < 0) return -1;
  std::string proof;
  try {
    if (!token.empty()) proof = rpc::internal::auth_proof(token, {"rpc", transport, from, to});
  } catch (const std::exception& e) {  // no randomness for the proof's nonce, say
    ::close(fd);
    *error = absl::StrCat("cannot prove this worker to ", endpoint, ": ", e.what());
    return -1;
  }
  std::string hello(kHelloFixedBytes, '\0');
  std::memcpy(hello.data(), magic, 4);
  put_u32(hello.data() + 4, static_cast<uint32_t>(from));
  put_u32(hello.data() + 8, static_cast<uint32_t>(to));
  put_u32(hello.data() + 12, static_cast<uint32_t>(proof.size()));
  hello += proof;
  char ack[sizeof(kHelloAck)];
  // The hello and its answer within connect_timeout in all: a listener that
  // trickles its answer cannot hold this thread longer.
  const absl::Time deadline = absl::Now() + connect_timeout;
  absl::Status ok =
      write_all(fd, hello.data(), hello.size(), connect_timeout, deadline, interrupt);
  if (ok.ok()) ok = read_exact(fd, ack, sizeof(ack), connect_timeout, deadline, interrupt);
  if (ok.ok() && std::memcmp(ack, kHelloAck, sizeof(ack)) != 0) {
    ok = absl::DataLossError("it answered the hello with something else");
  }
  if (!ok.ok()) {
    ::close(fd);
    *error = absl::IsCancelled(ok)
                 ? absl::StrCat("did not finish the bulk handshake with ", endpoint,
                                ": shutting down")
                 : absl::StrCat("refused the bulk connection (", ok.message(), ")");
    return -1;
  }
  set_silence(fd, silence);
  return fd;
}

int listen_on(const std::string& bracketed, int* port, std::string* error) {
  std::string host = bracketed;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), "0", &hints, &found); rc != 0) {
    *error = absl::StrCat("cannot resolve ", host, ": ", gai_strerror(rc));
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      *error = absl::StrCat("cannot listen on ", host, ": ", strerror(errno));
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) return -1;
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                     : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return fd;
}

}  // namespace ddprpc::rpc::transport::bulk
