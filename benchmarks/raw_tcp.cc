#include "benchmarks/raw_tcp.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "rpc/core/internal/receive_low_water.h"

namespace ddprpc::benchmarks {
namespace {

// A peer that says nothing for this long ends the measurement.
constexpr int kSilenceMs = 30000;

absl::Status errno_status(const char* what) {
  return absl::UnavailableError(absl::StrCat("raw TCP: ", what, ": ", std::strerror(errno)));
}

bool parse_ipv4(const std::string& host, int port, sockaddr_in* addr) {
  *addr = sockaddr_in{};
  addr->sin_family = AF_INET;
  addr->sin_port = htons(static_cast<uint16_t>(port));
  return ::inet_pton(AF_INET, host.c_str(), &addr->sin_addr) == 1;
}

// TCP_NODELAY, and sends that make no progress for kSilenceMs fail (a
// peer that stops reading cannot hold a writer for ever).
void configure(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  timeval limit{kSilenceMs / 1000, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
}

bool wait_for(int fd, short events) {
  pollfd p{fd, events, 0};
  int n;
  do {
    n = ::poll(&p, 1, kSilenceMs);
  } while (n < 0 && errno == EINTR);
  return n > 0;
}

absl::Status write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return errno_status("send");
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// With spin_us, a read looks without sleeping (recv that does not wait,
// yielding the CPU between looks) for up to that long before it polls.
absl::Status read_all(int fd, char* data, size_t size, int spin_us = 0) {
  const absl::Time spin_end = absl::Now() + absl::Microseconds(spin_us);
  while (size > 0 && spin_us > 0) {
    const ssize_t n = ::recv(fd, data, size, MSG_DONTWAIT);
    if (n > 0) {
      data += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return absl::UnavailableError("raw TCP: the peer closed the connection");
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return errno_status("recv");
    if (absl::Now() >= spin_end) break;
    sched_yield();
  }
  // Large reads wait for the receive low-water mark, as the runtime's bulk
  // streams do (rpc/core/internal/receive_low_water.h).
  const bool low_water = size >= rpc::internal::kLowWaterMinReadBytes;
  int mark = 1;
  absl::Status ok;
  while (ok.ok() && size > 0) {
    if (low_water) rpc::internal::expect_bytes(fd, size, &mark);
    if (!wait_for(fd, POLLIN)) {
      ok = absl::DeadlineExceededError("raw TCP: the peer went silent");
      break;
    }
    const ssize_t n = ::recv(fd, data, size, MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n == 0) ok = absl::UnavailableError("raw TCP: the peer closed the connection");
    if (n < 0) ok = errno_status("recv");
    if (n <= 0) break;
    data += n;
    size -= static_cast<size_t>(n);
  }
  rpc::internal::reset_low_water(fd, &mark);
  return ok;
}

// A barrier for `n` threads, passed once per round.
class RoundBarrier {
 public:
  explicit RoundBarrier(int n) : n_(n) {}
  void arrive_and_wait() {
    absl::MutexLock lock(&mu_);
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++round_;
      return;
    }
    struct Seen {
      const int64_t* round;
      int64_t value;
    } seen{&round_, round_};
    mu_.Await(absl::Condition(+[](Seen* s) { return *s->round != s->value; }, &seen));
  }

 private:
  absl::Mutex mu_;
  const int n_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t round_ ABSL_GUARDED_BY(mu_) = 0;
};

// Runs body(stream) for each stream on a thread of its own, at the normal
// scheduling policy whatever the caller's (an RPC handler's may be
// SCHED_BATCH, which delays wake-ups); the first error wins.
absl::Status on_streams(int n, const std::function<absl::Status(int)>& body) {
  std::vector<absl::Status> status(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      sched_param normal{};
      ::sched_setscheduler(0, SCHED_OTHER, &normal);  // this thread only
      status[i] = body(i);
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Stream i's share of `bytes`: [offset, offset + size).
std::pair<size_t, size_t> share(int64_t bytes, int streams, int i) {
  const size_t chunk = (static_cast<size_t>(bytes) + streams - 1) / streams;
  const size_t offset = std::min(static_cast<size_t>(bytes), chunk * i);
  return {offset, std::min(chunk, static_cast<size_t>(bytes) - offset)};
}

void close_all(const std::vector<int>& fds) {
  for (int fd : fds) {
    if (fd >= 0) ::close(fd);
  }
}

}  // namespace

absl::Status raw_tcp_listen(const std::string& address, RawTcpListener* out) {
  sockaddr_in addr;
  if (!parse_ipv4(address, 0, &addr)) {
    return absl::InvalidArgumentError(absl::StrCat("raw TCP: not an IPv4 address: ", address));
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno_status("socket");
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(fd, 16) != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const absl::Status s = errno_status("bind/listen");
    ::close(fd);
    return s;
  }
  out->fd = fd;
  out->port = ntohs(addr.sin_port);
  return absl::OkStatus();
}

absl::Status raw_tcp_round_trips(RawTcpListener listener, int streams, int64_t bytes, int warmup,
                                 int rounds, std::vector<double>* micros, int spin_us) {
  std::vector<int> fds;
  absl::Status s;
  while (s.ok() && static_cast<int>(fds.size()) < streams) {
    if (!wait_for(listener.fd, POLLIN)) {
      s = absl::DeadlineExceededError("raw TCP: the echo never connected");
      break;
    }
    const int fd = ::accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      s = errno_status("accept");
      break;
    }
    configure(fd);
    fds.push_back(fd);
  }
  ::close(listener.fd);
  if (!s.ok()) {
    close_all(fds);
    return s;
  }
  std::string out(static_cast<size_t>(bytes), '\1');
  std::string in(static_cast<size_t>(bytes), '\0');
  RoundBarrier start(streams), end(streams);
  s = on_streams(streams, [&](int i) {
    const auto [offset, size] = share(bytes, streams, i);
    absl::Status ok;
    for (int r = 0; r < warmup + rounds; ++r) {
      start.arrive_and_wait();
      const absl::Time t0 = absl::Now();
      if (ok.ok()) ok = write_all(fds[i], out.data() + offset, size);
      if (ok.ok()) ok = read_all(fds[i], in.data() + offset, size, spin_us);
      end.arrive_and_wait();
      if (i == 0 && ok.ok() && r >= warmup) {
        micros->push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      }
    }
    return ok;
  });
  close_all(fds);
  if (s.ok() && in != out) s = absl::DataLossError("raw TCP: the echo changed the bytes");
  return s;
}

absl::Status raw_tcp_echo(const std::string& host, int port, int streams, int64_t bytes,
                          int total_rounds, int spin_us) {
  sockaddr_in addr;
  if (!parse_ipv4(host, port, &addr)) {
    return absl::InvalidArgumentError(absl::StrCat("raw TCP: not an IPv4 address: ", host));
  }
  std::vector<int> fds;
  for (int i = 0; i < streams; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      const absl::Status s = errno_status("connect");
      if (fd >= 0) ::close(fd);
      close_all(fds);
      return s;
    }
    configure(fd);
    fds.push_back(fd);
  }
  std::string buffer(static_cast<size_t>(bytes), '\0');
  RoundBarrier whole(streams);
  const absl::Status s = on_streams(streams, [&](int i) {
    const auto [offset, size] = share(bytes, streams, i);
    absl::Status ok;
    for (int r = 0; r < total_rounds; ++r) {
      if (ok.ok()) ok = read_all(fds[i], buffer.data() + offset, size, spin_us);
      whole.arrive_and_wait();  // echoed once all of it came, as a reply
      if (ok.ok()) ok = write_all(fds[i], buffer.data() + offset, size);
    }
    return ok;
  });
  close_all(fds);
  return s;
}

absl::Status raw_tcp_ring_connect(RawTcpListener listener, const std::string& next_host,
                                  int next_port, RawTcpRing* out) {
  *out = RawTcpRing{};
  sockaddr_in addr;
  absl::Status s;
  if (!parse_ipv4(next_host, next_port, &addr)) {
    s = absl::InvalidArgumentError(absl::StrCat("raw TCP: not an IPv4 address: ", next_host));
  }
  // The next rank's kernel completes the connection before it accepts, so
  // every rank may connect first and accept second.
  if (s.ok()) {
    out->to_next = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (out->to_next < 0 ||
        ::connect(out->to_next, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      s = errno_status("connect");
    }
  }
  if (s.ok() && !wait_for(listener.fd, POLLIN)) {
    s = absl::DeadlineExceededError("raw TCP: the previous rank never connected");
  }
  if (s.ok()) {
    out->from_previous = ::accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (out->from_previous < 0) s = errno_status("accept");
  }
  ::close(listener.fd);
  if (!s.ok()) {
    raw_tcp_ring_close(out);
    return s;
  }
  configure(out->to_next);
  configure(out->from_previous);
  return s;
}

absl::Status raw_tcp_ring_round(const RawTcpRing& ring, const std::string& out, std::string* in) {
  in->resize(out.size());
  absl::Status sent;
  std::thread writer([&] {
    sched_param normal{};
    ::sched_setscheduler(0, SCHED_OTHER, &normal);  // this thread only
    sent = write_all(ring.to_next, out.data(), out.size());
  });
  const absl::Status read = read_all(ring.from_previous, in->data(), in->size());
  writer.join();
  return sent.ok() ? read : sent;
}

void raw_tcp_ring_close(RawTcpRing* ring) {
  close_all({ring->to_next, ring->from_previous});
  *ring = RawTcpRing{};
}

}  // namespace ddprpc::benchmarks
