#include "ddp/internal/tcp_ring.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <random>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace ddprpc::ddp::internal {
namespace {

// connect()'s hello, from rank r to rank r + 1: magic, u32 from, u32 to,
// then the 64-character proof. The answer is kAck.
constexpr char kHelloMagic[4] = {'D', 'D', 'R', '1'};
constexpr char kAck[4] = {'O', 'K', '.', '.'};
constexpr size_t kProofBytes = 64;
constexpr size_t kHelloBytes = 12 + kProofBytes;
// Each allreduce's header: magic, u32 sequence, u64 elements, u32 element
// size, u32 dtype, u32 reduction, u32 0.
constexpr char kHeaderMagic[4] = {'D', 'D', 'R', 'A'};
constexpr size_t kHeaderBytes = 32;
// A connection that has not proved itself within this long is closed.
constexpr absl::Duration kHelloTimeout = absl::Seconds(5);
// Blocking socket calls return at least this often, to check the
// deadline and whether the call failed elsewhere.
constexpr absl::Duration kSlice = absl::Milliseconds(200);
// Reduce-scatter bytes are read into the staging buffer this much at a
// time, then reduced into the caller's buffer; allgather bytes go straight
// there, at most this much per read. Between 4 network namespaces on 2
// cores, pieces of 128 KiB, 256 KiB and 1 MiB (and writes of 256 KiB to 4
// MiB) all came within 1.04-1.23x of a plain TCP ring at 4-64 MiB, the
// differences inside the runs' spread; 1 MiB pieces wake the reader least.
constexpr size_t kPieceBytes = 1 << 20;
// The writer sends at most this much per call.
constexpr int64_t kMaxWriteBytes = 1 << 20;

void put_u32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
void put_u64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}
uint64_t get_u64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

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
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

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

// Writes n bytes on a socket prepared by prepare_stream; "" or the error.
std::string send_all(int fd, const char* p, size_t n, absl::Time deadline,
                     const std::atomic<bool>* cancel, const std::string& peer) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    std::string error = stalled(k < 0 ? -1 : 1, errno, deadline, cancel, peer);
    if (!error.empty()) return error;
  }
  return "";
}

// Reads exactly n bytes; "" or the error.
std::string recv_all(int fd, char* p, size_t n, absl::Time deadline,
                     const std::atomic<bool>* cancel, const std::string& peer) {
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, MSG_WAITALL);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    std::string error = stalled(static_cast<int>(k), errno, deadline, cancel, peer);
    if (!error.empty()) return error;
  }
  return "";
}

std::string rank_name(int rank) { return absl::StrCat("rank ", rank); }

// The proof rank `from` gives rank `to`, whose nonce it is.
std::string proof(const TcpRing::Options& options, int from, int to, const std::string& nonce) {
  const std::string hex = absl::BytesToHexString(nonce);
  if (!options.sign) return hex + hex;  // 64 characters: the nonce itself
  std::string tag =
      options.sign(absl::StrCat("tcp-ring|", options.scope, "|", from, "|", to, "|", hex));
  if (tag.size() != kProofBytes) {
    throw std::logic_error("TcpRing: the signer's MAC is not 64 hex digits");
  }
  return tag;
}

bool equal_in_constant_time(const char* a, const char* b, size_t n) {
  unsigned char diff = 0;
  for (size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

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

// Accepts connections on `listener` until one proves it comes from rank
// `from` to rank `to` with `expected` as its proof; strangers are closed.
Fd accept_proved(int listener, int from, int to, const std::string& expected, absl::Time deadline,
                 const std::atomic<bool>& cancel, std::string* error) {
  struct Pending {
    Fd fd;
    std::string hello;
    absl::Time until;
  };
  std::deque<Pending> pending;
  set_nonblocking(listener, true);
  while (true) {
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      *error = absl::StrCat("no connection from rank ", from, " proved itself before the deadline");
      return Fd();
    }
    if (cancel.load()) {
      *error = "cancelled";
      return Fd();
    }
    // Drop the connections whose handshake ran out.
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [now](const Pending& p) { return p.until <= now; }),
                  pending.end());
    absl::Time wake = std::min(deadline, now + kSlice);  // checks `cancel` this often
    std::vector<pollfd> fds{{listener, POLLIN, 0}};
    for (const Pending& p : pending) {
      fds.push_back({p.fd.get(), POLLIN, 0});
      wake = std::min(wake, p.until);
    }
    if (::poll(fds.data(), fds.size(), poll_ms(wake)) < 0 && errno != EINTR) {
      *error = absl::StrCat("poll: ", errno_text(errno));
      return Fd();
    }
    // Reads what a connection has sent: 1 when it proved itself, -1 when it
    // is to be closed, 0 while its hello is incomplete.
    auto feed = [&](Pending& p) {
      char buffer[kHelloBytes];
      const ssize_t k = ::recv(p.fd.get(), buffer, kHelloBytes - p.hello.size(), 0);
      if (k <= 0) return k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
      p.hello.append(buffer, static_cast<size_t>(k));
      const char* h = p.hello.data();
      // The fixed part is refused as soon as it is in.
      if (p.hello.size() >= 12 &&
          (std::memcmp(h, kHelloMagic, 4) != 0 || get_u32(h + 4) != static_cast<uint32_t>(from) ||
           get_u32(h + 8) != static_cast<uint32_t>(to))) {
        return -1;
      }
      if (p.hello.size() < kHelloBytes) return 0;
      return equal_in_constant_time(h + 12, expected.data(), kProofBytes) ? 1 : -1;
    };
    auto proved = [](Pending& p) {
      Fd fd = std::move(p.fd);
      prepare_stream(fd.get());
      return fd;
    };
    for (size_t i = pending.size(); i-- > 0;) {
      if (fds[i + 1].revents == 0) continue;
      const int state = feed(pending[i]);
      if (state > 0) return proved(pending[i]);
      if (state < 0) pending.erase(pending.begin() + static_cast<long>(i));
    }
    if (fds[0].revents != 0) {
      // At most a pending set's worth per round, so that a stream of
      // connections cannot keep this loop from its deadline and its reads.
      for (int accepted = 0; accepted < TcpRing::kMaxPendingHellos; ++accepted) {
        Fd fd(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (fd.get() < 0) break;
        // A hello that came with the connection is read at once, so that a
        // crowd of connections cannot push a proving one out unread.
        Pending p{std::move(fd), std::string(), std::min(deadline, absl::Now() + kHelloTimeout)};
        const int state = feed(p);
        if (state > 0) return proved(p);
        if (state < 0) continue;
        if (pending.size() >= static_cast<size_t>(TcpRing::kMaxPendingHellos)) {
          // The oldest connection that has sent nothing gives way (else the
          // oldest): a hello that is on its way is not pushed out by a
          // crowd of silent connections.
          auto silent = std::find_if(pending.begin(), pending.end(),
                                     [](const Pending& q) { return q.hello.empty(); });
          pending.erase(silent != pending.end() ? silent : pending.begin());
        }
        pending.push_back(std::move(p));
      }
    }
  }
}

std::string nonce_bytes(int64_t a, int64_t b) {
  std::string nonce(16, '\0');
  put_u64(nonce.data(), static_cast<uint64_t>(a));
  put_u64(nonce.data() + 8, static_cast<uint64_t>(b));
  return nonce;
}

}  // namespace

std::unique_ptr<TcpRing> TcpRing::connect(int rank, int size, const Allgather& allgather,
                                          const Options& options, std::string* why) {
  if (size < 2) {
    *why = "a group of one rank";
    return nullptr;
  }
  const std::string me = absl::StrCat("rank ", rank, " of ", size);
  // Take part if enabled and able to listen; every rank learns who is.
  Fd listener;
  in_addr ip{};
  int port = 0;
  std::string mine_why;
  if (!options.enabled) {
    mine_why = absl::StrCat(me, " has the TCP ring off");
  } else if (::inet_pton(AF_INET, options.listen_address.c_str(), &ip) != 1) {
    mine_why = absl::StrCat(me, " listens on '", options.listen_address, "', not an IPv4 address");
  } else {
    listener = Fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr = ip;
    socklen_t len = sizeof(addr);
    if (listener.get() < 0 ||
        ::bind(listener.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listener.get(), kMaxPendingHellos) != 0 ||
        ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      mine_why = absl::StrCat(me, " cannot listen on ", options.listen_address, ": ",
                              errno_text(errno));
      listener.reset();
    } else {
      port = ntohs(addr.sin_port);
    }
  }
  if (mine_why.empty() && options.sign) {
    std::string tag;
    try {
      tag = options.sign("tcp-ring|check");
    } catch (const std::exception& e) {
      tag = e.what();
    }
    if (tag.size() != kProofBytes) {
      mine_why = absl::StrCat(me, "'s signer does not give a 64-digit MAC");
      listener.reset();
    }
  }
  std::random_device device;  // the kernel's random bytes
  auto random64 = [&device] {
    return static_cast<int64_t>((static_cast<uint64_t>(device()) << 32) | device());
  };
  constexpr size_t kFields = 5;  // taking part, IPv4 address, port, nonce (2)
  const std::vector<int64_t> all = allgather(
      {mine_why.empty() ? 1 : 0, static_cast<int64_t>(ntohl(ip.s_addr)), port, random64(),
       random64()});
  if (all.size() != kFields * static_cast<size_t>(size)) {
    throw std::logic_error("TcpRing::connect: the allgather returned the wrong length");
  }
  for (int r = 0; r < size; ++r) {
    if (all[r * kFields] == 0) {
      *why = r == rank ? mine_why : absl::StrCat("rank ", r, " of ", size, " does not take part");
      return nullptr;
    }
  }
  const int next = (rank + 1) % size, previous = (rank + size - 1) % size;
  const int64_t* next_fields = &all[next * kFields];
  const std::string my_nonce = nonce_bytes(all[rank * kFields + 3], all[rank * kFields + 4]);
  const std::string next_nonce = nonce_bytes(next_fields[3], next_fields[4]);
  const absl::Time deadline = absl::Now() + options.timeout;
  auto failure = [&](const std::string& what) {
    return std::runtime_error(absl::StrCat("TcpRing (", me, "): ", what));
  };
  // Take the previous rank's connection on a thread of its own while this
  // one connects to the next rank and proves who this is: strangers that
  // fill the listener's backlog delay a connection only until that thread
  // accepts them. The door closes once the previous rank is in. Either side
  // failing cancels the other.
  const std::string expected = proof(options, previous, rank, my_nonce);
  const std::string mine = proof(options, rank, next, next_nonce);
  std::string hello(kHelloMagic, 4);
  hello.resize(12);
  put_u32(hello.data() + 4, static_cast<uint32_t>(rank));
  put_u32(hello.data() + 8, static_cast<uint32_t>(next));
  hello += mine;
  std::atomic<bool> cancel{false};
  std::string accept_error;
  Fd from_previous;
  auto accept = [&] {
    try {
      from_previous =
          accept_proved(listener.get(), previous, rank, expected, deadline, cancel, &accept_error);
      listener.reset();
      if (from_previous.get() >= 0) {
        accept_error = send_all(from_previous.get(), kAck, 4, deadline, &cancel, rank_name(previous));
        if (!accept_error.empty()) from_previous.reset();
      }
    } catch (const std::exception& e) {
      accept_error = e.what();
      from_previous.reset();
    }
    if (from_previous.get() < 0) cancel.store(true);
  };
  // A connection the next rank closed unanswered was pushed out by others
  // before its hello was read (or this rank's proof is wrong): try again
  // until the deadline.
  std::string error;
  Fd to_next;
  auto connect_next = [&] {
    while (true) {
      to_next = connect_ipv4(static_cast<uint32_t>(next_fields[1]),
                             static_cast<int>(next_fields[2]), deadline, &cancel, &error);
      if (to_next.get() < 0) {
        error = absl::StrCat("cannot connect to rank ", next, ": ", error);
        return;
      }
      char ack[4];
      error = send_all(to_next.get(), hello.data(), hello.size(), deadline, &cancel, rank_name(next));
      if (error.empty()) error = recv_all(to_next.get(), ack, 4, deadline, &cancel, rank_name(next));
      if (error.empty()) {
        if (std::memcmp(ack, kAck, 4) != 0) error = absl::StrCat("rank ", next, " answered garbage");
        return;
      }
      to_next.reset();
      if (cancel.load()) return;
      if (absl::Now() >= deadline) {
        error = absl::StrCat("rank ", next,
                             " did not accept this rank's connection before the deadline (do both "
                             "hold the job's secret?): ",
                             error);
        return;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  };
  try {
    std::thread acceptor(accept);
    try {
      connect_next();
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (!error.empty()) cancel.store(true);
    acceptor.join();
  } catch (const std::system_error& e) {  // no thread
    error = absl::StrCat("cannot start the accepting thread: ", e.what());
  }
  if (error.empty() || error == "cancelled") error = accept_error;
  // Every rank gets a ring or none does: a rank whose neighbours both
  // connected must not go on with a ring its peers gave up on.
  const std::vector<int64_t> ok = allgather({error.empty() ? 1 : 0});
  std::string failed;
  for (int r = 0; r < size && r < static_cast<int>(ok.size()); ++r) {
    if (ok[r] == 0) absl::StrAppend(&failed, failed.empty() ? "" : ", ", r);
  }
  if (!error.empty()) throw failure(error);
  if (!failed.empty()) throw failure(absl::StrCat("rank(s) ", failed, " could not join the ring"));
  return std::unique_ptr<TcpRing>(
      new TcpRing(rank, size, to_next.release(), from_previous.release()));
}

TcpRing::TcpRing(int rank, int size, int to_next, int from_previous)
    : rank_(rank), size_(size), to_next_(to_next), from_previous_(from_previous),
      staging_(kPieceBytes) {}

TcpRing::~TcpRing() {
  if (to_next_ >= 0) ::close(to_next_);
  if (from_previous_ >= 0) ::close(from_previous_);
}

std::string TcpRing::who() const { return absl::StrCat("TcpRing (rank ", rank_, " of ", size_, ")"); }

void TcpRing::fail(const std::string& error) {
  if (broken_.empty()) broken_ = error;
  failed_.store(true);
  ::shutdown(to_next_, SHUT_RDWR);
  ::shutdown(from_previous_, SHUT_RDWR);
  std::lock_guard<std::mutex> lock(mu_);
  progress_.notify_all();
}

void TcpRing::write_items(const char* header, size_t header_bytes,
                          const std::vector<int64_t>& offsets, const std::vector<int64_t>& lengths,
                          const std::vector<int64_t>& needed, char* base, absl::Time deadline) {
  const std::string next = rank_name((rank_ + 1) % size_);
  std::string error = send_all(to_next_, header, header_bytes, deadline, &failed_, next);
  for (size_t k = 0; error.empty() && k < offsets.size(); ++k) {
    int64_t sent = 0;
    while (error.empty() && sent < lengths[k]) {
      // Item k > 0 is what the reader received as item k - 1: only the
      // bytes it has finished may go on.
      int64_t ready = lengths[k];
      if (k > 0) {
        ready = std::min(lengths[k], received_.load() - needed[k]);
        if (ready <= sent) {
          std::unique_lock<std::mutex> lock(mu_);
          writer_waiting_.store(true);
          progress_.wait_for(lock, slice_until(deadline),
                             [&] { return received_.load() - needed[k] > sent || failed_.load(); });
          writer_waiting_.store(false);
          lock.unlock();
          if (failed_.load()) error = "cancelled";
          else if (absl::Now() >= deadline && received_.load() - needed[k] <= sent) {
            error = absl::StrCat("waited past the deadline for rank ", (rank_ + size_ - 1) % size_,
                                 "'s bytes");
          }
          continue;
        }
      }
      const int64_t n = std::min(ready - sent, kMaxWriteBytes);
      error = send_all(to_next_, base + offsets[k] + sent, static_cast<size_t>(n), deadline,
                       &failed_, next);
      sent += n;
    }
    if (error.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      items_sent_ = static_cast<int>(k) + 1;
      progress_.notify_all();
    }
  }
  if (!error.empty() && !failed_.exchange(true)) {
    // The first failure of the call: the reader's error is only its echo.
    writer_error_ = std::move(error);
    ::shutdown(from_previous_, SHUT_RDWR);  // wakes the reader in a read
    std::lock_guard<std::mutex> lock(mu_);  // and in a wait
    progress_.notify_all();
  }
}

void TcpRing::allreduce(void* data, int64_t numel, size_t element_size, int dtype,
                        Reduction reduction, ReduceFn reduce, absl::Time deadline) {
  if (!broken_.empty()) {
    throw std::runtime_error(
        absl::StrCat(who(), ": the ring failed in an earlier allreduce: ", broken_));
  }
  if (numel < 0 || element_size < 1 || element_size > 16) {
    throw std::invalid_argument(absl::StrCat(who(), ": ", numel, " elements of ", element_size,
                                             " bytes"));
  }
  ++sequence_;
  const int n = size_, r = rank_;
  const int previous = (r + n - 1) % n;
  auto chunk_begin = [&](int c) { return c * (numel / n) + std::min<int64_t>(c, numel % n); };
  auto chunk = [&](int c) { return ((c % n) + n) % n; };
  // Item k of the writer is chunk send[k]; item i of the reader is chunk
  // recv[i]: n - 1 reduce-scatter steps, then n - 1 allgather steps.
  const int items = 2 * (n - 1);
  std::vector<int64_t> send_offsets(items), send_lengths(items), needed(items, 0);
  std::vector<int64_t> recv_offsets(items), recv_lengths(items);
  const auto bytes = static_cast<int64_t>(element_size);
  for (int k = 0; k < items; ++k) {
    const int s = k < n - 1 ? chunk(r - k) : chunk(r + 1 - (k - (n - 1)));
    const int v = k < n - 1 ? chunk(r - k - 1) : chunk(r - (k - (n - 1)));
    send_offsets[k] = chunk_begin(s) * bytes;
    send_lengths[k] = (chunk_begin(s + 1) - chunk_begin(s)) * bytes;
    recv_offsets[k] = chunk_begin(v) * bytes;
    recv_lengths[k] = (chunk_begin(v + 1) - chunk_begin(v)) * bytes;
  }
  for (int k = 1; k < items; ++k) needed[k] = needed[k - 1] + (k > 1 ? recv_lengths[k - 2] : 0);
  char header[kHeaderBytes] = {};
  std::memcpy(header, kHeaderMagic, 4);
  put_u32(header + 4, sequence_);
  put_u64(header + 8, static_cast<uint64_t>(numel));
  put_u32(header + 16, static_cast<uint32_t>(element_size));
  put_u32(header + 20, static_cast<uint32_t>(dtype));
  put_u32(header + 24, static_cast<uint32_t>(reduction));

  char* base = static_cast<char*>(data);
  received_.store(0);
  items_sent_ = 0;
  failed_.store(false);
  writer_error_.clear();
  std::thread writer;
  try {
    writer = std::thread([&] {
      try {
        write_items(header, kHeaderBytes, send_offsets, send_lengths, needed, base, deadline);
      } catch (const std::exception& e) {
        if (!failed_.exchange(true)) {
          writer_error_ = e.what();
          ::shutdown(from_previous_, SHUT_RDWR);
          std::lock_guard<std::mutex> lock(mu_);
          progress_.notify_all();
        }
      }
    });
  } catch (const std::system_error& e) {
    fail(absl::StrCat("cannot start the writing thread: ", e.what()));
    throw std::runtime_error(absl::StrCat(who(), " allreduce ", sequence_, ": ", broken_));
  }
  const std::string from = rank_name(previous);
  auto done = [this](int64_t n_bytes) {
    received_.fetch_add(n_bytes);
    if (writer_waiting_.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      progress_.notify_one();
    }
  };
  std::string error;
  // Nothing may leave this block by an exception while the writer runs.
  try {
    char theirs[kHeaderBytes];
    error = recv_all(from_previous_, theirs, kHeaderBytes, deadline, &failed_, from);
    if (error.empty() && std::memcmp(theirs, header, kHeaderBytes) != 0) {
      error = absl::StrCat(
          "rank ", previous, " started allreduce ", get_u32(theirs + 4), " of ", get_u64(theirs + 8),
          " elements of ", get_u32(theirs + 16), " bytes (dtype ", get_u32(theirs + 20),
          ", reduction ", get_u32(theirs + 24), "); this rank's allreduce ", sequence_, " has ",
          numel, " elements of ", element_size, " bytes (dtype ", dtype, ", reduction ",
          static_cast<int>(reduction), ")");
      if (std::memcmp(theirs, kHeaderMagic, 4) != 0) {
        error = absl::StrCat("rank ", previous, " sent no allreduce header");
      }
    }
    for (int i = 0; error.empty() && i < items; ++i) {
      const bool reducing = i < n - 1;
      if (!reducing) {
        // Allgather step j overwrites the chunk the writer sent as its item j.
        // Those bytes went round the ring before these final ones could come
        // back, so the writer is long done; waiting for it here makes that
        // order visible to the memory model (and to ThreadSanitizer).
        const int j = i - (n - 1);
        std::unique_lock<std::mutex> lock(mu_);
        while (items_sent_ <= j && !failed_.load() && absl::Now() < deadline) {
          progress_.wait_for(lock, slice_until(deadline));
        }
        if (items_sent_ <= j) {
          error = failed_.load() ? "cancelled"
                                 : absl::StrCat("this rank's writes to rank ", (r + 1) % n,
                                                " did not end before the deadline");
          break;
        }
      }
      char* at = base + recv_offsets[i];
      int64_t left = recv_lengths[i];
      while (error.empty() && left > 0) {
        if (reducing) {
          const auto piece = static_cast<size_t>(
              std::min<int64_t>(left, kPieceBytes - kPieceBytes % element_size));
          error = recv_all(from_previous_, staging_.data(), piece, deadline, &failed_, from);
          if (!error.empty()) break;
          reduce(at, at, staging_.data(), piece / element_size);
          at += piece;
          left -= static_cast<int64_t>(piece);
          done(static_cast<int64_t>(piece));
        } else {
          const ssize_t k = ::recv(from_previous_, at,
                                   static_cast<size_t>(std::min<int64_t>(left, kPieceBytes)), 0);
          if (k > 0) {
            at += k;
            left -= k;
            done(k);
          } else {
            error = stalled(static_cast<int>(k), errno, deadline, &failed_, from);
          }
        }
      }
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty() && !failed_.exchange(true)) {
    ::shutdown(to_next_, SHUT_RDWR);  // wakes the writer
    std::lock_guard<std::mutex> lock(mu_);
    progress_.notify_all();
  }
  writer.join();
  // Whichever side failed first says why (writer_error_ is set only then).
  if (!writer_error_.empty()) error = writer_error_;
  if (!error.empty()) {
    fail(error);
    throw std::runtime_error(absl::StrCat(who(), " allreduce ", sequence_, ": ", error));
  }
}

}  // namespace ddprpc::ddp::internal
