// The bulk path's lending and pulling sides on their own, over loopback,
// without gRPC (so that they run under TSan too): which pulls a listener
// serves, the bounds of its lend table, and pulls from several threads at
// once.
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/equal.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/transport/internal/bulk_lender.h"
#include "rpc/transport/internal/bulk_puller.h"
#include "rpc/transport/internal/bulk_pusher.h"
#include "rpc/transport/internal/bulk_wire.h"
#include "rpc/core/internal/auth.h"

namespace ddprpc::rpc::transport {
namespace {

constexpr char kToken[] = "bulk-test-token";

// The listener of worker 0 in a world of `world_size`, serving `table`.
std::unique_ptr<bulk::Listener> listener_of_worker0(
    std::shared_ptr<bulk::LendTable> table, int world_size, int max_per_peer = 12,
    const std::function<void(bulk::ListenerLimits&)>& adjust = nullptr) {
  bulk::ListenerLimits limits;
  limits.self = 0;
  limits.world_size = world_size;
  limits.token = kToken;
  limits.max_connections_per_peer = max_per_peer;
  if (adjust) adjust(limits);
  std::string error;
  auto listener = bulk::Listener::start("127.0.0.1", limits, std::move(table), nullptr, &error);
  EXPECT_NE(listener, nullptr) << error;
  return listener;
}

TEST(BulkLenderTest, APullMayNameOnlyItsOwnLendsWithinTheirBytes) {
  auto table = std::make_shared<bulk::LendTable>(int64_t{64} << 20, int64_t{4} << 20,
                                                 absl::Seconds(60));
  auto listener = listener_of_worker0(table, 3);
  ASSERT_NE(listener, nullptr);
  const std::string ep = absl::StrCat("127.0.0.1:", listener->port());
  at::Tensor t = at::arange(1 << 18, at::kInt);  // 1 MiB
  const uint64_t id = table->lend(/*peer=*/1, /*frame_id=*/9, t, /*reply=*/false);
  ASSERT_NE(id, 0u);

  auto puller = [&](int self) {
    bulk::PullerOptions o;
    o.self = self;
    o.lender = 0;
    o.endpoint = ep;
    o.token = kToken;
    return std::make_unique<bulk::Puller>(o);
  };
  at::Tensor into = at::empty_like(t);
  // Worker 2 cannot pull worker 1's lend, nor can anyone pull past its end.
  absl::Status other = puller(2)->pull(id, into.data_ptr(), t.nbytes());
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound) << other;
  EXPECT_NE(other.ToString().find("worker 0"), std::string::npos) << other;
  std::vector<char> past(t.nbytes() + 4096);
  absl::Status too_far = puller(1)->pull(id, past.data(), past.size());
  EXPECT_EQ(too_far.code(), absl::StatusCode::kOutOfRange) << too_far;
  EXPECT_EQ(table->size(), 1u);  // still lent
  // Its own pull reads every byte and ends the lend.
  auto own = puller(1);
  absl::Status pulled = own->pull(id, into.data_ptr(), t.nbytes());
  ASSERT_TRUE(pulled.ok()) << pulled;
  EXPECT_TRUE(at::equal(into, t));
  for (int i = 0; i < 500 && table->size() != 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(table->size(), 0u);
  EXPECT_EQ(own->pull(id, into.data_ptr(), t.nbytes()).code(), absl::StatusCode::kNotFound);
  // The bounds per peer: a lend past one is refused, another peer's is not;
  // replies (4 MiB here) are bounded apart from requests (64 MiB).
  at::Tensor huge = at::arange(int64_t{17} << 20, at::kInt);  // 68 MiB
  EXPECT_EQ(table->lend(1, 10, huge, false), 0u);
  const uint64_t a = table->lend(1, 11, t, false), b = table->lend(2, 11, t, false);
  EXPECT_NE(a, 0u);
  EXPECT_NE(b, 0u);
  table->release_request(1, 11);
  EXPECT_EQ(table->size(), 1u);
  EXPECT_EQ(table->lent_bytes(1), 0);
  for (int i = 0; i < 4; ++i) EXPECT_NE(table->lend(1, 20 + i, t, /*reply=*/true), 0u) << i;
  EXPECT_EQ(table->lend(1, 30, t, /*reply=*/true), 0u);
  EXPECT_NE(table->lend(1, 31, t, /*reply=*/false), 0u);
  EXPECT_EQ(table->lent_bytes(1), 5 * static_cast<int64_t>(t.nbytes()));
  // The reply to this worker's request 20 releases that request's lends,
  // not the lend of this worker's reply to the peer's own request 20.
  EXPECT_NE(table->lend(1, 20, t, /*reply=*/false), 0u);
  table->release_request(1, 20);
  EXPECT_EQ(table->lent_bytes(1), 5 * static_cast<int64_t>(t.nbytes()));
}

TEST(BulkLenderTest, PullsFromSeveralThreadsAtOnceEachGetTheirOwnBytes) {
  auto table = std::make_shared<bulk::LendTable>(int64_t{256} << 20, int64_t{256} << 20,
                                                 absl::Seconds(60));
  auto listener = listener_of_worker0(table, 5);
  ASSERT_NE(listener, nullptr);
  // Workers 1..4 pull, each its own tensors, 20 times over; worker 4 has
  // two threads sharing one puller.
  std::vector<std::thread> threads;
  std::vector<int> failures(5, 0);
  auto run = [&](int worker, int slot, bulk::Puller* puller) {
    for (int i = 0; i < 20; ++i) {
      at::Tensor t = at::arange((1 << 18) + worker * 1000 + i, at::kInt) + worker;
      const uint64_t id = table->lend(worker, i, t, /*reply=*/i % 2 == 0);
      at::Tensor into = at::empty_like(t);
      if (id == 0 || !puller->pull(id, into.data_ptr(), t.nbytes()).ok() || !at::equal(into, t)) {
        ++failures[slot];
      }
    }
  };
  std::vector<std::unique_ptr<bulk::Puller>> pullers;
  for (int w = 1; w <= 4; ++w) {
    bulk::PullerOptions o;
    o.self = w;
    o.lender = 0;
    o.endpoint = absl::StrCat("127.0.0.1:", listener->port());
    o.token = kToken;
    pullers.push_back(std::make_unique<bulk::Puller>(o));
  }
  for (int w = 1; w <= 4; ++w) threads.emplace_back(run, w, w - 1, pullers[w - 1].get());
  threads.emplace_back(run, 4, 4, pullers[3].get());
  for (auto& t : threads) t.join();
  for (int slot = 0; slot < 5; ++slot) EXPECT_EQ(failures[slot], 0) << slot;
  for (int i = 0; i < 500 && table->size() != 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(table->size(), 0u);  // every lend released by its puller
  listener->shutdown();
  EXPECT_EQ(listener->connections(), 0);
}

// Opens a connection to `port` proven as worker `from`; -1 if refused.
int proven_connection(int port, int from) {
  std::string error;
  const int fd = bulk::connect_to(absl::StrCat("127.0.0.1:", port), absl::Seconds(5), &error);
  if (fd < 0) return -1;
  const std::string proof = rpc::internal::auth_proof(kToken, {"rpc", "bulk", from, 0});
  std::string hello(bulk::kHelloFixedBytes, '\0');
  std::memcpy(hello.data(), bulk::kHelloMagic, 4);
  bulk::put_u32(hello.data() + 4, from);
  bulk::put_u32(hello.data() + 8, 0);
  bulk::put_u32(hello.data() + 12, proof.size());
  hello += proof;
  char ack[4];
  if (!bulk::write_all(fd, hello.data(), hello.size(), absl::Seconds(5)).ok() ||
      !bulk::read_exact(fd, ack, 4, absl::Seconds(5)).ok()) {
    ::close(fd);
    return -1;
  }
  return fd;
}

TEST(BulkLenderTest, AWorkerPastItsConnectionsPushesOutItsOldestAndIsNeverLockedOut) {
  auto table = std::make_shared<bulk::LendTable>(int64_t{64} << 20, int64_t{64} << 20,
                                                 absl::Seconds(60));
  auto listener = listener_of_worker0(table, 3, 2);
  ASSERT_NE(listener, nullptr);
  // Connections its puller gave up on (a partition, say) stay open here.
  const int first = proven_connection(listener->port(), 1);
  const int second = proven_connection(listener->port(), 1);
  const int other = proven_connection(listener->port(), 2);
  ASSERT_GE(first, 0);
  ASSERT_GE(second, 0);
  ASSERT_GE(other, 0);
  // A third of worker 1 is admitted; its oldest is closed, worker 2's is not.
  const int third = proven_connection(listener->port(), 1);
  ASSERT_GE(third, 0);
  char byte;
  EXPECT_EQ(bulk::read_exact(first, &byte, 1, absl::Seconds(5)).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(bulk::read_exact(other, &byte, 1, absl::Milliseconds(300)).code(),
            absl::StatusCode::kDeadlineExceeded);  // still open, silent
  for (int fd : {first, second, third, other}) ::close(fd);
}

TEST(BulkLenderTest, APullerThatDrainsTooSlowlyIsCutOffThoughItNeverStops) {
  auto table = std::make_shared<bulk::LendTable>(int64_t{64} << 20, int64_t{4} << 20,
                                                 absl::Seconds(60));
  auto listener = listener_of_worker0(table, 2, 12, [](bulk::ListenerLimits& limits) {
    limits.silence = absl::Seconds(1);
  });
  ASSERT_NE(listener, nullptr);
  std::string error;
  const at::Tensor t = at::arange(int64_t{12} << 20, at::kInt);  // 48 MiB
  const uint64_t id = table->lend(/*peer=*/1, /*frame_id=*/1, t, /*reply=*/false);
  ASSERT_NE(id, 0u);
  const int fd = bulk::connect_proven(absl::StrCat("127.0.0.1:", listener->port()),
                                      bulk::kHelloMagic, "bulk", 1, 0, kToken, absl::Seconds(10),
                                      absl::Seconds(30), &error);
  ASSERT_GE(fd, 0) << error;
  char pull[bulk::kPullBytes];
  bulk::put_u64(pull, id);
  bulk::put_u64(pull + 8, 0);
  bulk::put_u64(pull + 16, t.nbytes());
  ASSERT_TRUE(bulk::write_all_blocking(fd, pull, sizeof(pull)).ok());
  // 64 KiB every 20 ms (3.2 MiB/s): never silent for the limit, but far
  // below the least rate a transfer is held to (silence + 48 MiB at 16
  // MiB/s: 4 s), so the lender ends it long before the 15 s this would take.
  std::vector<char> chunk(64 << 10);
  uint64_t received = 0;
  const absl::Time start = absl::Now();
  while (absl::Now() - start < absl::Seconds(20)) {
    const ssize_t n = ::recv(fd, chunk.data(), chunk.size(), 0);
    if (n <= 0) break;
    received += static_cast<uint64_t>(n);
    absl::SleepFor(absl::Milliseconds(20));
  }
  const absl::Duration took = absl::Now() - start;
  EXPECT_LT(received, t.nbytes() + bulk::kReplyHeadBytes) << "the whole tensor went out";
  EXPECT_LT(took, absl::Seconds(12));
  ::close(fd);
}

TEST(BulkLenderTest, LendsExpireAfterTheTimeoutOrAtTheirCallsLaterDeadline) {
  bulk::LendTable table(int64_t{64} << 20, int64_t{64} << 20, absl::Milliseconds(100));
  const at::Tensor t = at::arange(1024, at::kInt);
  const uint64_t plain = table.lend(1, 1, t, /*reply=*/false);
  const uint64_t reply = table.lend(1, 1, t, /*reply=*/true);
  const uint64_t earlier = table.lend(1, 2, t, false, absl::Now() + absl::Milliseconds(10));
  const uint64_t later = table.lend(1, 3, t, false, absl::Now() + absl::Seconds(2));
  ASSERT_NE(plain * reply * earlier * later, 0u);
  EXPECT_EQ(table.size(), 4u);
  absl::SleepFor(absl::Milliseconds(300));
  table.expire();
  EXPECT_EQ(table.size(), 1u);
  EXPECT_FALSE(table.find(1, plain, 0, 4).ok());
  EXPECT_FALSE(table.find(1, earlier, 0, 4).ok());
  EXPECT_TRUE(table.find(1, later, 0, 4).ok());
  EXPECT_EQ(table.lent_bytes(1), 4096);
  // Released early, it leaves nothing behind to expire.
  table.release(1, later);
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.lent_bytes(1), 0);
  table.expire();
  EXPECT_EQ(table.size(), 0u);
}

// A lent tensor that the program points elsewhere before the pull (set_,
// or assigning .data) is pulled as it was lent: the lend holds its bytes,
// not the program's tensor object.
TEST(BulkLenderTest, ALendKeepsItsBytesWhenTheProgramRepointsItsTensor) {
  auto table = std::make_shared<bulk::LendTable>(int64_t{64} << 20, int64_t{4} << 20,
                                                 absl::Seconds(60));
  auto listener = listener_of_worker0(table, 2);
  ASSERT_NE(listener, nullptr);
  at::Tensor t = at::arange(1 << 18, at::kInt);  // 1 MiB
  const at::Tensor expected = t.clone();
  const uint64_t id = table->lend(/*peer=*/1, /*frame_id=*/1, t, /*reply=*/false);
  ASSERT_NE(id, 0u);
  t.set_(at::arange(16, at::kInt));  // its old storage has no other owner
  bulk::PullerOptions o;
  o.self = 1;
  o.lender = 0;
  o.endpoint = absl::StrCat("127.0.0.1:", listener->port());
  o.token = kToken;
  bulk::Puller puller(o);
  at::Tensor into = at::empty_like(expected);
  absl::Status pulled = puller.pull(id, into.data_ptr(), expected.nbytes());
  ASSERT_TRUE(pulled.ok()) << pulled;
  EXPECT_TRUE(at::equal(into, expected));
}

// A connection that sends its hello a byte at a time, each within the
// handshake timeout of the one before, is still cut off once the timeout
// has passed since it opened.
TEST(BulkLenderTest, AHelloTrickledAByteAtATimeEndsAtTheHandshakeTimeout) {
  auto table = std::make_shared<bulk::LendTable>(int64_t{64} << 20, int64_t{4} << 20,
                                                 absl::Seconds(60));
  auto listener = listener_of_worker0(table, 2, 12, [](bulk::ListenerLimits& limits) {
    limits.handshake_timeout = absl::Seconds(1);
  });
  ASSERT_NE(listener, nullptr);
  std::string error;
  const absl::Time start = absl::Now();
  const int fd = bulk::connect_to(absl::StrCat("127.0.0.1:", listener->port()), absl::Seconds(5),
                                  &error);
  ASSERT_GE(fd, 0) << error;
  std::string hello(bulk::kHelloFixedBytes, '\0');
  std::memcpy(hello.data(), bulk::kHelloMagic, 4);
  bulk::put_u32(hello.data() + 4, 1);
  bulk::put_u32(hello.data() + 8, 0);
  bulk::put_u32(hello.data() + 12, 64);
  hello += std::string(64, 'p');
  absl::Duration closed_after = absl::InfiniteDuration();
  for (char byte : hello) {
    if (::send(fd, &byte, 1, MSG_NOSIGNAL) != 1) break;
    char c;
    if (::recv(fd, &c, 1, MSG_DONTWAIT) == 0) {
      closed_after = absl::Now() - start;
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));  // the whole hello: 8 s
  }
  if (closed_after == absl::InfiniteDuration()) {
    char c;
    if (bulk::read_exact(fd, &c, 1, absl::Seconds(5)).code() == absl::StatusCode::kUnavailable) {
      closed_after = absl::Now() - start;
    }
  }
  EXPECT_LT(closed_after, absl::Seconds(3)) << "the trickled hello held its connection";
  ::close(fd);
}

// A connected loopback pair of bulk-path sockets: {writer, reader}.
std::pair<int, int> connected_pair() {
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  EXPECT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&a), len), 0);
  EXPECT_EQ(::listen(listener, 1), 0);
  EXPECT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len), 0);
  std::string error;
  const int writer = bulk::connect_to(absl::StrCat("127.0.0.1:", ntohs(a.sin_port)),
                                      absl::Seconds(5), &error);
  EXPECT_GE(writer, 0) << error;
  const int reader = writer >= 0 ? ::accept(listener, nullptr, nullptr) : -1;
  ::close(listener);
  return {writer, reader};
}

// A large blocking read waits for the receive low-water mark in poll(),
// so it ends when its last bytes come, though part of them waited before
// it began and the rest are fewer than the mark (a blocking recv() would
// copy the first part and sleep on until the silence limit), and it
// leaves the mark at its default.
TEST(BulkLenderTest, ALargeReadEndsWhenItsLastBytesComeAfterAPause) {
  const std::pair<int, int> pair = connected_pair();
  const int writer = pair.first, reader = pair.second;
  ASSERT_GE(reader, 0);
  bulk::set_silence(reader, absl::Seconds(5));
  constexpr size_t kBytes = 400 << 10;
  std::vector<char> out(kBytes);
  for (size_t i = 0; i < kBytes; ++i) out[i] = static_cast<char>(i * 7);
  std::thread sender([&] {
    size_t at = 0;
    for (size_t part : {size_t{200} << 10, size_t{200} << 10}) {
      if (at > 0) absl::SleepFor(absl::Milliseconds(200));
      EXPECT_TRUE(bulk::write_all(writer, out.data() + at, part, absl::Seconds(5)).ok());
      at += part;
    }
  });
  std::vector<char> in(kBytes);
  absl::SleepFor(absl::Milliseconds(100));  // the first part waits
  const absl::Time start = absl::Now();
  const absl::Status read = bulk::read_exact_blocking(reader, in.data(), in.size());
  const absl::Duration took = absl::Now() - start;
  sender.join();
  EXPECT_TRUE(read.ok()) << read;
  EXPECT_TRUE(in == out);
  EXPECT_LT(took, absl::Seconds(3)) << "the read waited for its silence limit";
  int mark = 0;
  socklen_t len = sizeof(mark);
  ASSERT_EQ(::getsockopt(reader, SOL_SOCKET, SO_RCVLOWAT, &mark, &len), 0);
  EXPECT_EQ(mark, 1);
  ::close(writer);
  ::close(reader);
}

// Under the low-water mark a large read still counts bytes below the mark
// as progress: a peer that sends a little every 700 ms with a silence
// limit of 1 s is read to the end, and only a silence without a byte
// fails the read.
TEST(BulkLenderTest, ALargeReadFailsOnlyAfterASilenceWithoutAByte) {
  const std::pair<int, int> pair = connected_pair();
  const int writer = pair.first, reader = pair.second;
  ASSERT_GE(reader, 0);
  bulk::set_silence(reader, absl::Seconds(1));
  constexpr size_t kPart = 150 << 10;
  std::vector<char> out(4 * kPart, 'b');
  std::thread sender([&] {
    for (size_t at = 0; at < out.size(); at += kPart) {
      absl::SleepFor(at == 0 ? absl::Milliseconds(100) : absl::Milliseconds(700));
      EXPECT_TRUE(bulk::write_all(writer, out.data() + at, kPart, absl::Seconds(5)).ok());
    }
  });
  std::vector<char> in(out.size());
  absl::Status read = bulk::read_exact_blocking(reader, in.data(), in.size());
  sender.join();
  EXPECT_TRUE(read.ok()) << read;
  EXPECT_TRUE(in == out);

  const absl::Time start = absl::Now();
  read = bulk::read_exact_blocking(reader, in.data(), in.size());
  EXPECT_EQ(read.code(), absl::StatusCode::kDeadlineExceeded) << read;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  ::close(writer);
  ::close(reader);
}

// A loopback socket that listens and never accepts nor answers. Listening
// with a backlog of 0, Linux queues one connection; with that one queued
// (`fill_backlog`), later connects get no answer to their SYN and wait.
// Otherwise they are queued by the kernel and wait for an answer to their
// hello that never comes.
struct SilentListener {
  explicit SilentListener(bool fill_backlog) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), len), 0);
    EXPECT_EQ(::listen(fd, fill_backlog ? 0 : 8), 0);
    EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
    endpoint = absl::StrCat("127.0.0.1:", ntohs(a.sin_port));
    if (fill_backlog) {
      std::string error;
      queued = bulk::connect_to(endpoint, absl::Seconds(5), &error);
      EXPECT_GE(queued, 0) << error;
    }
  }
  ~SilentListener() {
    if (queued >= 0) ::close(queued);
    ::close(fd);
  }
  // Waits until `n` connections wait in the queue (at most 10 s).
  bool wait_queued(unsigned n) const {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    for (;;) {
      tcp_info info{};
      socklen_t len = sizeof(info);
      // On a listening socket, tcpi_unacked is the accept queue's length.
      if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) == 0 && info.tcpi_unacked >= n) {
        return true;
      }
      if (absl::Now() > until) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  int fd;
  int queued = -1;
  std::string endpoint;
};

// A pull whose connection waits on a lender that never answers its
// hello ends as soon as the puller is aborted, not at the connect timeout.
TEST(BulkLenderTest, AbortingAPullerEndsItsConnectInProgress) {
  SilentListener silent(/*fill_backlog=*/false);
  bulk::PullerOptions o;
  o.self = 1;
  o.lender = 0;
  o.endpoint = silent.endpoint;
  o.token = kToken;
  o.connect_timeout = absl::Seconds(30);
  bulk::Puller puller(o);
  std::vector<char> into(1 << 20);
  absl::Status pulled;
  absl::Time ended;
  std::thread pull([&] {
    pulled = puller.pull(1, into.data(), into.size());
    ended = absl::Now();
  });
  ASSERT_TRUE(silent.wait_queued(1)) << "the puller did not connect";
  absl::SleepFor(absl::Milliseconds(50));  // its hello sent, it waits for the answer
  const absl::Time aborted = absl::Now();
  puller.abort();
  pull.join();
  EXPECT_EQ(pulled.code(), absl::StatusCode::kCancelled) << pulled;
  EXPECT_LT(ended - aborted, absl::Seconds(2)) << "the pull waited out its connect";
}

// A pusher whose receiver does not answer its SYN, and one whose receiver
// does not answer its hello, are each destroyed at once (a worker's
// shutdown waits for them), not at the connect timeout.
TEST(BulkLenderTest, DestroyingAPusherEndsItsConnectInProgress) {
  for (bool fill_backlog : {true, false}) {
    SCOPED_TRACE(fill_backlog ? "SYN unanswered" : "hello unanswered");
    SilentListener silent(fill_backlog);
    bulk::PusherOptions o;
    o.self = 1;
    o.receiver = 0;
    o.endpoint = silent.endpoint;
    o.token = kToken;
    o.connect_timeout = absl::Seconds(30);
    auto pusher = std::make_unique<bulk::Pusher>(o);
    const at::Tensor tensor = at::arange(int64_t{1} << 18);
    // The first push finds no connection and opens them in the background.
    EXPECT_EQ(pusher->push(1, tensor), 0u);
    if (fill_backlog) {
      absl::SleepFor(absl::Milliseconds(300));  // its SYN dropped, it waits
    } else {
      ASSERT_TRUE(silent.wait_queued(1)) << "the pusher did not connect";
      absl::SleepFor(absl::Milliseconds(50));
    }
    const absl::Time start = absl::Now();
    pusher.reset();
    EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "the pusher waited out its connect";
  }
}

}  // namespace
}  // namespace ddprpc::rpc::transport
