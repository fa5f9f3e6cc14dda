#include "ddp/internal/tcp_ring.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "ddp/internal/ring_socket.h"
#include "gtest/gtest.h"

namespace ddprpc::ddp::internal {
namespace {

template <typename T, typename Op>
void loop(void* out, const void* a, const void* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    static_cast<T*>(out)[i] = Op()(static_cast<const T*>(a)[i], static_cast<const T*>(b)[i]);
  }
}
template <typename T>
struct Min {
  T operator()(T a, T b) const { return std::min(a, b); }
};
template <typename T>
struct Max {
  T operator()(T a, T b) const { return std::max(a, b); }
};
template <typename T>
ReduceFn reduce_fn(Reduction op) {
  if (op == Reduction::kMin) return &loop<T, Min<T>>;
  if (op == Reduction::kMax) return &loop<T, Max<T>>;
  return &loop<T, std::plus<T>>;
}

// Allgathers among `size` threads, round after round; `hook` sees the
// first round's result before any rank gets it (where a test plays a
// stranger at the listeners).
class Exchange {
 public:
  // Each round waits `wait` for every rank; the first `first_wait` (as
  // long as `wait` unless given), the time threads take to start.
  explicit Exchange(int size, absl::Duration wait = absl::Seconds(20),
                    std::optional<absl::Duration> first_wait = std::nullopt)
      : size_(size), wait_(wait), first_wait_(first_wait.value_or(wait)), parts_(size) {}
  std::function<void(const std::vector<int64_t>&)> hook;

  std::vector<int64_t> run(int rank, std::vector<int64_t> mine) {
    absl::MutexLock lock(&mu_);
    const size_t round = results_.size();
    parts_[rank] = std::move(mine);
    if (++arrived_ == size_) {
      std::vector<int64_t> all;
      for (const auto& p : parts_) all.insert(all.end(), p.begin(), p.end());
      if (round == 0 && hook) hook(all);
      results_.push_back(std::move(all));
      arrived_ = 0;
    }
    auto done = [this, round] { return results_.size() > round; };
    // As a group's allgather, which fails at its timeout.
    if (!mu_.AwaitWithTimeout(absl::Condition(&done), round == 0 ? first_wait_ : wait_)) {
      throw std::runtime_error(absl::StrCat("allgather round ", round, ": not every rank came"));
    }
    return results_[round];
  }

 private:
  const int size_;
  const absl::Duration wait_;
  const absl::Duration first_wait_;
  absl::Mutex mu_;
  std::vector<std::vector<int64_t>> parts_;
  int arrived_ = 0;
  std::vector<std::vector<int64_t>> results_;
};

// A stand-in for the job's MAC: 64 hex digits that depend on the message
// and the key.
std::function<std::string(absl::string_view)> signer(const std::string& key) {
  return [key](absl::string_view m) {
    std::string out;
    for (int i = 0; i < 4; ++i) {
      const size_t h = std::hash<std::string>()(absl::StrCat(key, i, m));
      char bytes[8];
      std::memcpy(bytes, &h, 8);
      out += absl::BytesToHexString(absl::string_view(bytes, 8));
    }
    return out;
  };
}

struct Ranks {
  std::vector<std::unique_ptr<TcpRing>> rings;
  std::vector<std::string> errors;  // setup errors, by rank
  std::vector<std::string> why;
};

// Builds a ring of `size` threads on loopback; options_of(r) sets rank r's.
Ranks build(int size, Exchange& exchange,
            const std::function<void(int, TcpRing::Options&)>& options_of = nullptr) {
  Ranks out;
  out.rings.resize(size);
  out.errors.resize(size);
  out.why.resize(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      TcpRing::Options o;
      o.listen_address = "127.0.0.1";
      o.timeout = absl::Seconds(20);
      o.scope = "test/";
      if (options_of) options_of(r, o);
      try {
        out.rings[r] = TcpRing::connect(
            r, size, [&exchange, r](std::vector<int64_t> mine) { return exchange.run(r, mine); },
            o, &out.why[r]);
      } catch (const std::exception& e) {
        out.errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// Runs one float sum on every ring (rank r's element i is i % 7 + r) and
// checks the result; returns each rank's error ("" when it succeeded).
std::vector<std::string> sum_floats(Ranks& ranks, int64_t numel,
                                    absl::Duration timeout = absl::Seconds(30)) {
  const int size = static_cast<int>(ranks.rings.size());
  std::vector<std::string> errors(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      std::vector<float> data(static_cast<size_t>(numel));
      for (int64_t i = 0; i < numel; ++i) data[i] = static_cast<float>(i % 7 + r);
      try {
        ranks.rings[r]->allreduce(data.data(), numel, sizeof(float), 6, Reduction::kSum,
                                  reduce_fn<float>(Reduction::kSum), absl::Now() + timeout);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        return;
      }
      const float ranks_sum = static_cast<float>(size * (size - 1) / 2);
      for (int64_t i = 0; i < numel; ++i) {
        if (data[i] != static_cast<float>(size * (i % 7)) + ranks_sum) {
          errors[r] = absl::StrCat("rank ", r, " element ", i, " is ", data[i]);
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// Ranks `callers` each sum numel_of(rank) ones; each rank's error ("" on
// success). The others do not call.
std::vector<std::string> call_each(Ranks& ranks, const std::vector<int>& callers,
                                   const std::function<int64_t(int)>& numel_of,
                                   absl::Duration timeout) {
  std::vector<std::string> errors(ranks.rings.size());
  std::vector<std::thread> threads;
  for (int r : callers) {
    threads.emplace_back([&, r] {
      std::vector<float> data(static_cast<size_t>(numel_of(r)), 1.0f);
      try {
        ranks.rings[r]->allreduce(data.data(), numel_of(r), 4, 6, Reduction::kSum,
                                  reduce_fn<float>(Reduction::kSum), absl::Now() + timeout);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

TEST(TcpRingTest, SumsEveryElementForEachGroupSizeAndLength) {
  for (int size : {2, 3, 4}) {
    Exchange exchange(size);
    Ranks ranks = build(size, exchange);
    for (int r = 0; r < size; ++r) ASSERT_NE(ranks.rings[r], nullptr) << ranks.errors[r];
    // Lengths shorter than the group, not divisible by it, and spanning
    // many staging pieces.
    for (int64_t numel : {1, 2, 5, 1001, 300007, 2 << 20}) {
      for (const std::string& e : sum_floats(ranks, numel)) {
        EXPECT_EQ(e, "") << "size " << size << " numel " << numel;
      }
    }
  }
}

TEST(TcpRingTest, MinMaxAndOtherDtypes) {
  constexpr int kSize = 3;
  Exchange exchange(kSize);
  Ranks ranks = build(kSize, exchange);
  for (int r = 0; r < kSize; ++r) ASSERT_NE(ranks.rings[r], nullptr) << ranks.errors[r];
  constexpr int64_t kNumel = 100003;
  std::vector<std::vector<int64_t>> longs(kSize, std::vector<int64_t>(kNumel));
  std::vector<std::vector<double>> doubles(kSize, std::vector<double>(kNumel));
  std::vector<std::thread> threads;
  for (int r = 0; r < kSize; ++r) {
    threads.emplace_back([&, r] {
      for (int64_t i = 0; i < kNumel; ++i) {
        longs[r][i] = (i + r) % kSize - (int64_t{1} << 40);
        doubles[r][i] = 0.5 * ((i * 7 + r) % 11);
      }
      auto deadline = absl::Now() + absl::Seconds(30);
      ranks.rings[r]->allreduce(longs[r].data(), kNumel, 8, 4, Reduction::kMin,
                                reduce_fn<int64_t>(Reduction::kMin), deadline);
      ranks.rings[r]->allreduce(doubles[r].data(), kNumel, 8, 7, Reduction::kMax,
                                reduce_fn<double>(Reduction::kMax), deadline);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kSize; ++r) {
    for (int64_t i = 0; i < kNumel; ++i) {
      double max = 0;
      for (int q = 0; q < kSize; ++q) max = std::max(max, 0.5 * ((i * 7 + q) % 11));
      ASSERT_EQ(longs[r][i], -(int64_t{1} << 40)) << r << " " << i;
      ASSERT_EQ(doubles[r][i], max) << r << " " << i;
    }
  }
}

TEST(TcpRingTest, CallsThatDisagreeFailOnEveryRankNamingBoth) {
  constexpr int kSize = 3;
  Exchange exchange(kSize);
  Ranks ranks = build(kSize, exchange);
  for (int r = 0; r < kSize; ++r) ASSERT_NE(ranks.rings[r], nullptr) << ranks.errors[r];
  const absl::Time start = absl::Now();
  const std::vector<std::string> errors = call_each(
      ranks, {0, 1, 2}, [](int r) -> int64_t { return r == 1 ? 4096 : 8192; }, absl::Seconds(60));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // not the deadline
  for (int r = 0; r < kSize; ++r) EXPECT_NE(errors[r], "") << r;
  // The first failure is a header that does not match: rank 1 reading
  // rank 0's or rank 2 reading rank 1's; the others may see only a
  // neighbour close.
  const std::string mismatch = errors[1].find("started allreduce") != std::string::npos ? errors[1]
                                                                                         : errors[2];
  EXPECT_TRUE(mismatch.find("rank 0 started allreduce 1 of 8192 elements of 4 bytes") !=
                  std::string::npos ||
              mismatch.find("rank 1 started allreduce 1 of 4096 elements of 4 bytes") !=
                  std::string::npos)
      << errors[1] << "\n" << errors[2];
  EXPECT_NE(mismatch.find("this rank's is allreduce 1 of"), std::string::npos) << mismatch;
  // The ring stays broken.
  for (const std::string& e : sum_floats(ranks, 1000)) {
    EXPECT_NE(e.find("failed in an earlier allreduce"), std::string::npos) << e;
  }
}

// Parts of an allreduce striped over several rings look alike on one ring
// when the ranks cut different wholes (a 256 KiB call whole on one rank,
// the first half of a 512 KiB call on the other), and two ops may reduce
// alike: the header tells them apart, and both ranks fail.
TEST(TcpRingTest, PartsOfDifferentWholesOrOtherOpsFailOnEveryRank) {
  struct Case {
    RingCall zero, one;
    const char* says;
  };
  const Case cases[] = {
      {{65536, 0, 1, 0}, {131072, 0, 2, 0}, "part 0 of 2 of 131072 elements"},
      {{65536, 0, 1, 0}, {65536, 0, 1, 1}, "op 1,"},
  };
  for (const Case& c : cases) {
    Exchange exchange(2);
    Ranks ranks = build(2, exchange);
    for (int r = 0; r < 2; ++r) ASSERT_NE(ranks.rings[r], nullptr) << ranks.errors[r];
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        std::vector<float> data(65536, 1.0f);
        try {
          ranks.rings[r]->allreduce(data.data(), data.size(), 4, 6, Reduction::kSum,
                                    reduce_fn<float>(Reduction::kSum),
                                    absl::Now() + absl::Seconds(60), r == 0 ? c.zero : c.one);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_NE(errors[0], "") << c.says;
    EXPECT_NE(errors[1], "") << c.says;
    EXPECT_TRUE(errors[0].find(c.says) != std::string::npos ||
                errors[1].find(c.says) != std::string::npos)
        << errors[0] << "\n" << errors[1];
  }
}

TEST(TcpRingTest, APeerThatClosesMidTransferFailsTheOthersAtOnce) {
  constexpr int kSize = 3;
  Exchange exchange(kSize);
  Ranks ranks = build(kSize, exchange);
  for (int r = 0; r < kSize; ++r) ASSERT_NE(ranks.rings[r], nullptr) << ranks.errors[r];
  const absl::Time start = absl::Now();
  // Ranks 0 and 1 sum 64 MiB (more than the sockets buffer); rank 2 never
  // calls: it goes away while the others are writing to it and waiting for
  // its bytes.
  std::thread closer([&ranks] {
    absl::SleepFor(absl::Milliseconds(300));
    ranks.rings[2].reset();
  });
  const std::vector<std::string> errors =
      call_each(ranks, {0, 1}, [](int) -> int64_t { return 16 << 20; }, absl::Seconds(120));
  closer.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  // Rank 2's neighbours find it gone (rank 0 reads its end, rank 1's
  // writes fail); whichever fails first closes the ring, so the other may
  // see that instead.
  EXPECT_NE(errors[0].find("TcpRing (rank 0 of 3) allreduce 1: "), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("TcpRing (rank 1 of 3) allreduce 1: "), std::string::npos) << errors[1];
  EXPECT_TRUE(errors[0].find("rank 2") != std::string::npos ||
              errors[1].find("rank 2") != std::string::npos)
      << errors[0] << "\n" << errors[1];
}

TEST(TcpRingTest, AStalledPeerFailsTheCallAtItsDeadline) {
  constexpr int kSize = 2;
  Exchange exchange(kSize);
  Ranks ranks = build(kSize, exchange);
  for (int r = 0; r < kSize; ++r) ASSERT_NE(ranks.rings[r], nullptr) << ranks.errors[r];
  std::vector<float> data(1 << 20, 1.0f);
  const absl::Time start = absl::Now();
  try {
    ranks.rings[0]->allreduce(data.data(), data.size(), 4, 6, Reduction::kSum,
                              reduce_fn<float>(Reduction::kSum), absl::Now() + absl::Seconds(1));
    ADD_FAILURE() << "an allreduce without its peer succeeded";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("deadline"), std::string::npos) << e.what();
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

using ring::Fd;

// A connected loopback TCP pair: [0] prepared as the ring's sockets are.
std::array<Fd, 2> tcp_pair() {
  Fd listener(::socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(::listen(listener.get(), 1), 0);
  EXPECT_EQ(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);
  Fd near(::socket(AF_INET, SOCK_STREAM, 0));
  EXPECT_EQ(::connect(near.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  Fd far(::accept(listener.get(), nullptr, nullptr));
  ring::prepare_stream(near.get());
  return {std::move(near), std::move(far)};
}

// A read that waits for the receive low-water mark ends when its last
// bytes come, though part of them waited before it began and the rest are
// fewer than the mark: a blocking recv() would copy the first part and
// sleep on (this socket has no receive timeout), since the kernel wakes it
// only once a full mark of new bytes waits.
TEST(TcpRingTest, ALowWaterReadEndsWhenItsLastBytesComeAfterAPause) {
  std::array<Fd, 2> pair = tcp_pair();
  timeval none{};
  ::setsockopt(pair[0].get(), SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
  constexpr size_t kBytes = 400 << 10;
  std::vector<char> out(kBytes);
  for (size_t i = 0; i < kBytes; ++i) out[i] = static_cast<char>(i * 7);
  absl::Notification read;
  std::thread sender([&] {
    size_t at = 0;
    for (size_t part : {size_t{200} << 10, size_t{200} << 10}) {
      if (at > 0) absl::SleepFor(absl::Milliseconds(200));
      EXPECT_EQ(ring::send_all(pair[1].get(), out.data() + at, part, absl::Now() + absl::Seconds(5),
                               nullptr, "rank 0"),
                "");
      at += part;
    }
    // Bounds the test if the read sleeps on: its socket is shut down.
    if (!read.WaitForNotificationWithTimeout(absl::Seconds(5))) {
      ::shutdown(pair[0].get(), SHUT_RDWR);
    }
  });
  std::vector<char> in(kBytes);
  int mark = 1;
  absl::SleepFor(absl::Milliseconds(100));  // the first part waits
  const absl::Time start = absl::Now();
  const std::string error = ring::recv_all(pair[0].get(), in.data(), in.size(),
                                           start + absl::Seconds(10), nullptr, "rank 1", &mark);
  read.Notify();
  sender.join();
  EXPECT_EQ(error, "");
  EXPECT_TRUE(in == out);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// A peer that moves a byte now and then keeps every socket call making
// progress: the transfer must still end at its deadline.
TEST(TcpRingTest, APeerThatTricklesBytesFailsTheTransferAtItsDeadline) {
  std::array<Fd, 2> pair = tcp_pair();
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    while (!stop.load()) {
      (void)!::send(pair[1].get(), "x", 1, MSG_NOSIGNAL);
      absl::SleepFor(absl::Milliseconds(50));
    }
  });
  std::vector<char> buffer(1 << 20);
  absl::Time start = absl::Now();
  std::string error = ring::recv_all(pair[0].get(), buffer.data(), buffer.size(),
                               start + absl::Seconds(1), nullptr, "rank 1");
  EXPECT_NE(error.find("rank 1"), std::string::npos) << error;
  EXPECT_NE(error.find("deadline"), std::string::npos) << error;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));

  // The other way: a reader that takes a few bytes at a time, once the
  // socket buffers are full.
  std::thread sip([&] {
    char b[64];
    while (!stop.load()) {
      (void)!::recv(pair[1].get(), b, sizeof(b), MSG_DONTWAIT);
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  std::vector<char> big(64 << 20);
  start = absl::Now();
  error = ring::send_all(pair[0].get(), big.data(), big.size(), start + absl::Seconds(1), nullptr,
                   "rank 1");
  EXPECT_NE(error.find("deadline"), std::string::npos) << error;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  stop = true;
  trickle.join();
  sip.join();
}

// Connects to host:port and writes `bytes` (kept open until the returned
// fd is closed). With no bytes the connection is not waited for: the
// listener's backlog may be full.
int stranger(uint32_t ip, int64_t port, const std::string& bytes) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | (bytes.empty() ? SOCK_NONBLOCK : 0), 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(ip);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 &&
      errno != EINPROGRESS) {
    ::close(fd);
    return -1;
  }
  if (!bytes.empty()) (void)!::write(fd, bytes.data(), bytes.size());
  return fd;
}

std::string hello(uint32_t from, uint32_t to, const std::string& proof) {
  std::string h = "DDR1";
  h.resize(12);
  std::memcpy(&h[4], &from, 4);  // little-endian hosts
  std::memcpy(&h[8], &to, 4);
  return h + proof;
}

TEST(TcpRingTest, StrangersAtTheListenersDoNotGetInOrStopTheRing) {
  constexpr int kSize = 3;
  Exchange exchange(kSize);
  std::vector<int> fds;
  exchange.hook = [&fds](const std::vector<int64_t>& all) {
    for (int r = 0; r < kSize; ++r) {
      const auto ip = static_cast<uint32_t>(all[r * 5 + 1]);
      const int64_t port = all[r * 5 + 2];
      const auto previous = static_cast<uint32_t>((r + kSize - 1) % kSize);
      fds.push_back(stranger(ip, port, "GET / HTTP/1.0\r\n\r\n" + std::string(80, 'x')));
      fds.push_back(stranger(ip, port, hello(previous, r, std::string(64, 'a'))));  // wrong proof
      fds.push_back(stranger(ip, port, hello(previous, r, "")));  // never finishes
      // Part of a hello, never the rest: as many as the listener's backlog
      // takes before anyone accepts (these connect blocking).
      for (int i = 0; i < TcpRing::kMaxPendingHellos - 4; ++i) {
        fds.push_back(stranger(ip, port, hello(previous, r, std::string(10, 'a'))));
      }
      for (int i = 0; i < 2 * TcpRing::kMaxPendingHellos; ++i) fds.push_back(stranger(ip, port, ""));
    }
  };
  Ranks ranks = build(kSize, exchange, [](int, TcpRing::Options& o) { o.sign = signer("job"); });
  for (int fd : fds) {
    if (fd >= 0) ::close(fd);
  }
  for (int r = 0; r < kSize; ++r) ASSERT_NE(ranks.rings[r], nullptr) << ranks.errors[r];
  for (const std::string& e : sum_floats(ranks, 300007)) EXPECT_EQ(e, "");
}

TEST(TcpRingTest, ARankWithoutTheSecretIsRefusedAndNamed) {
  constexpr int kSize = 3;
  Exchange exchange(kSize);
  const absl::Time start = absl::Now();
  Ranks ranks = build(kSize, exchange, [](int r, TcpRing::Options& o) {
    o.sign = signer(r == 1 ? "other" : "job");
    o.timeout = absl::Seconds(2);
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(ranks.rings[2], nullptr);
  EXPECT_NE(ranks.errors[2].find("no connection from rank 1 proved itself"), std::string::npos)
      << ranks.errors[2];
  EXPECT_EQ(ranks.rings[1], nullptr);
}

// Rank 1's own connections (from rank 0, to rank 2) both prove
// themselves; rank 3 holds another secret, so ranks 0, 2 and 3 fail. Rank 1
// must not keep a ring the others gave up on.
TEST(TcpRingTest, EveryRankGetsARingOrNoneDoes) {
  constexpr int kSize = 4;
  Exchange exchange(kSize);
  Ranks ranks = build(kSize, exchange, [](int r, TcpRing::Options& o) {
    o.sign = signer(r == 3 ? "other" : "job");
    o.timeout = absl::Seconds(2);
  });
  for (int r = 0; r < kSize; ++r) EXPECT_EQ(ranks.rings[r], nullptr) << r;
  EXPECT_NE(ranks.errors[1].find("rank(s) 0, 2, 3 could not join the ring"), std::string::npos)
      << ranks.errors[1];
  EXPECT_NE(ranks.errors[0].find("no connection from rank 3 proved itself"), std::string::npos)
      << ranks.errors[0];
}

// A rank whose signer fails once the ring is being built (after the check
// every rank makes before) fails with it, and so does every other rank,
// within the ring's timeout: it still takes part in the ranks' agreement.
// Options of a ring with a 2 s timeout whose rank 1 signs its first
// message, then fails.
void rank1_signer_fails_part_way(int r, TcpRing::Options& o) {
  o.timeout = absl::Seconds(2);
  if (r != 1) {
    o.sign = signer("job");
    return;
  }
  auto calls = std::make_shared<std::atomic<int>>(0);
  o.sign = [calls, good = signer("job")](absl::string_view message) {
    if (calls->fetch_add(1) > 0) throw std::runtime_error("no randomness left");
    return good(message);
  };
}

TEST(TcpRingTest, ASignerThatFailsPartWayFailsEveryRankWithinTheTimeout) {
  constexpr int kSize = 3;
  Exchange exchange(kSize);
  const absl::Time start = absl::Now();
  Ranks ranks = build(kSize, exchange, rank1_signer_fails_part_way);
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  for (int r = 0; r < kSize; ++r) {
    EXPECT_EQ(ranks.rings[r], nullptr) << r;
    EXPECT_NE(ranks.errors[r], "") << r;
  }
  EXPECT_NE(ranks.errors[1].find("cannot make the ring's proofs: no randomness left"),
            std::string::npos)
      << ranks.errors[1];
}

// The same when the ranks' agreement times out before the failing rank's
// neighbours come to it (a group's allgather has the ring's timeout, and
// the failing rank gets there first): it still reports its own error.
TEST(TcpRingTest, ARankThatFailsEarlyReportsItsOwnErrorWhenTheAgreementTimesOut) {
  constexpr int kSize = 3;
  Exchange exchange(kSize, /*wait=*/absl::Milliseconds(500), /*first_wait=*/absl::Seconds(20));
  Ranks ranks = build(kSize, exchange, rank1_signer_fails_part_way);
  for (int r = 0; r < kSize; ++r) EXPECT_EQ(ranks.rings[r], nullptr) << r;
  EXPECT_NE(ranks.errors[1].find("cannot make the ring's proofs: no randomness left"),
            std::string::npos)
      << ranks.errors[1];
}

TEST(TcpRingTest, NoRankBuildsARingWhenOneDoesNotTakePart) {
  constexpr int kSize = 3;
  Exchange exchange(kSize);
  Ranks ranks = build(kSize, exchange, [](int r, TcpRing::Options& o) {
    if (r == 2) o.listen_address = "localhost";
  });
  for (int r = 0; r < kSize; ++r) {
    EXPECT_EQ(ranks.rings[r], nullptr);
    EXPECT_EQ(ranks.errors[r], "");
  }
  EXPECT_EQ(ranks.why[0], "rank 2 of 3 does not take part");
  EXPECT_EQ(ranks.why[2], "rank 2 of 3 listens on 'localhost', not an IPv4 address");
}

}  // namespace
}  // namespace ddprpc::ddp::internal
