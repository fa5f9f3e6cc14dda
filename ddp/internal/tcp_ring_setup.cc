#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <random>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "ddp/internal/ring_socket.h"
#include "ddp/internal/tcp_ring.h"

// TcpRing's setup: the listener, the hello and its proof, the agreement.
namespace ddprpc::ddp::internal {
namespace {

using ring::connect_ipv4;
using ring::errno_text;
using ring::Fd;
using ring::get_u32;
using ring::kSlice;
using ring::poll_ms;
using ring::prepare_stream;
using ring::put_u32;
using ring::put_u64;
using ring::rank_name;
using ring::recv_all;
using ring::send_all;
using ring::set_nonblocking;

// connect()'s hello, from rank r to rank r + 1: magic, u32 from, u32 to,
// then the 64-character proof. The answer is kAck.
constexpr char kHelloMagic[4] = {'D', 'D', 'R', '1'};
constexpr char kAck[4] = {'O', 'K', '.', '.'};
constexpr size_t kProofBytes = 64;
constexpr size_t kHelloBytes = 12 + kProofBytes;
// A connection that has not proved itself within this long is closed.
constexpr absl::Duration kHelloTimeout = absl::Seconds(5);

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

// Accepts connections on `listener` until one proves it comes from rank
// `from` to rank `to` with `expected` as its proof; strangers are closed.
Fd accept_proved(int listener, int from, int to, const std::string& expected, absl::Time deadline,
                 const std::atomic<bool>& cancel, std::string* error) {
  struct Pending {
    Fd fd;
    std::string hello;
    absl::Time until;
    uint64_t round = 0;  // of the loop that accepted it
  };
  std::deque<Pending> pending;
  set_nonblocking(listener, true);
  for (uint64_t round = 0;; ++round) {
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
      return CRYPTO_memcmp(h + 12, expected.data(), kProofBytes) == 0 ? 1 : -1;  // constant time
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
        Pending p{std::move(fd), std::string(), std::min(deadline, absl::Now() + kHelloTimeout),
                  round};
        const int state = feed(p);
        if (state > 0) return proved(p);
        if (state < 0) continue;
        if (pending.size() >= static_cast<size_t>(TcpRing::kMaxPendingHellos)) {
          // A connection accepted in an earlier round gives way: the oldest
          // that has sent nothing, else the oldest. One accepted in this
          // round keeps its place until the next round has read what it
          // sent since (a rank's hello comes just after its connection), so
          // a crowd, silent or sending part of a hello, cannot push it out
          // unread; with every place taken in this round, the newcomer
          // gives way.
          auto earlier = [round](const Pending& q) { return q.round < round; };
          auto gives_way = std::find_if(pending.begin(), pending.end(), [&](const Pending& q) {
            return earlier(q) && q.hello.empty();
          });
          if (gives_way == pending.end()) {
            gives_way = std::find_if(pending.begin(), pending.end(), earlier);
          }
          if (gives_way == pending.end()) continue;
          pending.erase(gives_way);
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
  // A proof that cannot be made (the signer throws) fails this rank here,
  // and every rank at the agreement below, not this rank alone.
  std::string expected, mine, sign_error;
  try {
    expected = proof(options, previous, rank, my_nonce);
    mine = proof(options, rank, next, next_nonce);
  } catch (const std::exception& e) {
    sign_error = absl::StrCat("cannot make the ring's proofs: ", e.what());
    listener.reset();
  }
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
  if (!sign_error.empty()) {
    error = sign_error;
  } else {
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
  }
  // Every rank gets a ring or none does: a rank whose neighbours both
  // connected must not go on with a ring its peers gave up on.
  // A rank that failed early may reach the agreement a timeout before its
  // neighbours, which wait for it until their deadline, and see it time out
  // first: its own error is then what it reports.
  std::vector<int64_t> ok;
  try {
    ok = allgather({error.empty() ? 1 : 0});
  } catch (const std::exception& e) {
    if (error.empty()) throw;
    throw failure(absl::StrCat(error, " (and the ranks' agreement failed: ", e.what(), ")"));
  }
  std::string failed;
  for (int r = 0; r < size && r < static_cast<int>(ok.size()); ++r) {
    if (ok[r] == 0) absl::StrAppend(&failed, failed.empty() ? "" : ", ", r);
  }
  if (!error.empty()) throw failure(error);
  if (!failed.empty()) throw failure(absl::StrCat("rank(s) ", failed, " could not join the ring"));
  // The descriptors stay owned here until the ring is made (its buffer may
  // not be), then go to it.
  std::unique_ptr<TcpRing> ring(new TcpRing(rank, size, to_next.get(), from_previous.get()));
  (void)to_next.release();
  (void)from_previous.release();
  return ring;
}

}  // namespace ddprpc::ddp::internal
