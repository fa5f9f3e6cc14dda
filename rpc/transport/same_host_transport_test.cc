// The same-host transport on its own: frames with small and large tensors
// both ways, the fallback when the endpoint is elsewhere, and a server that
// ends hostile connections (bad handshakes, wrong tokens, lies about sizes
// or memory) while it keeps serving the others.
#include "rpc/transport/same_host_transport.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <gtest/gtest.h>
#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <set>
#include <thread>
#include <string>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/notification.h"
#include "glog/logging.h"
#include "rpc/core/internal/auth.h"
#include "rpc/testing/raw_http2.h"
#include "rpc/testing/raw_peer.h"
#include "rpc/transport/grpc_transport.h"
#include "rpc/transport/internal/same_host_protocol.h"

namespace ddprpc::rpc::transport {
namespace {

using internal::Frame;

Frame request(const at::Tensor& t, uint64_t id) {
  Frame f;
  f.header.set_kind(wire::REQUEST);
  f.header.set_id(id);
  f.header.set_src(0);
  internal::encode_value(c10::IValue(t), f.header.mutable_payload(), &f);
  return f;
}

class Echo {
 public:
  explicit Echo(Security security = {}, ServerLimits limits = {}) {
    limits.world_size = 2;
    transport_ = make_same_host_transport(make_default_transport());
    server_ = transport_->listen(
        "127.0.0.1", limits, security, [](int, const Frame&) { return absl::OkStatus(); },
        [this](std::shared_ptr<Responder> r, Frame f) { served(r, std::move(f)); },
        [this](std::shared_ptr<Responder> r, Frame f) { served(r, std::move(f)); });
  }
  void served(const std::shared_ptr<Responder>& r, Frame f) {
    {
      absl::MutexLock lock(&mu_);
      last_address_ = r->address();
    }
    reply(r, std::move(f));
  }
  // The address of the connection that sent the last request.
  std::string last_address() {
    absl::MutexLock lock(&mu_);
    return last_address_;
  }
  ~Echo() { server_->shutdown(absl::ZeroDuration()); }
  static void reply(const std::shared_ptr<Responder>& r, Frame f) {
    f.header.set_kind(wire::RESPONSE);
    r->send(std::move(f));
  }
  std::string endpoint() const { return server_->same_host_endpoint(); }
  // The abstract socket's name.
  std::string socket_name() const { return endpoint().substr(endpoint().rfind('|') + 1); }
  std::string address() const { return "127.0.0.1:" + std::to_string(server_->port()); }
  Transport* transport() { return transport_.get(); }

 private:
  absl::Mutex mu_;
  std::string last_address_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Transport> transport_;
  std::unique_ptr<Server> server_;
};

struct Replies {
  absl::Mutex mu;
  std::vector<Frame> frames ABSL_GUARDED_BY(mu);
  CloseReason closed ABSL_GUARDED_BY(mu);
  bool ended ABSL_GUARDED_BY(mu) = false;
  Channel::OnFrame on_frame() {
    return [this](Frame f) {
      absl::MutexLock lock(&mu);
      frames.push_back(std::move(f));
      return absl::OkStatus();
    };
  }
  Channel::OnClose on_close() {
    return [this](const CloseReason& r) {
      absl::MutexLock lock(&mu);
      closed = r;
      ended = true;
    };
  }
  bool wait_for(size_t n) {
    absl::MutexLock lock(&mu);
    auto got = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return frames.size() >= n || ended; };
    mu.AwaitWithTimeout(absl::Condition(&got), absl::Seconds(20));
    return frames.size() >= n;
  }
  bool wait_end() {
    absl::MutexLock lock(&mu);
    mu.AwaitWithTimeout(absl::Condition(&ended), absl::Seconds(20));
    return ended;
  }
};

// A channel of worker 1 to `echo`'s same-host endpoint.
std::shared_ptr<Channel> connect_as_worker1(Echo* echo, Replies* replies) {
  PeerOptions options;
  options.self = 1;
  options.same_host_endpoint = echo->endpoint();
  return echo->transport()->connect(echo->address(), options, replies->on_frame(),
                                    replies->on_close());
}

TEST(SameHostTransportTest, SmallAndLargeTensorsBothWays) {
  Echo echo;
  ASSERT_FALSE(echo.endpoint().empty());
  EXPECT_EQ(echo.endpoint().substr(0, echo.endpoint().rfind('|')), host_identity());
  Replies replies;
  auto ch = connect_as_worker1(&echo, &replies);
  ASSERT_TRUE(ch);
  // 16 B inline, 4 MiB copied from the sender's memory, and one in between.
  std::vector<at::Tensor> sent = {at::arange(4, at::kFloat), at::arange(1 << 20, at::kFloat),
                                  at::arange(static_cast<int64_t>(kCrossMemoryMinBytes / 8 - 1), at::kDouble)};
  for (size_t i = 0; i < sent.size(); ++i) {
    ASSERT_TRUE(ch->send(request(sent[i], i + 1), SendOptions{true, i > 0}));
  }
  ASSERT_TRUE(replies.wait_for(sent.size()));
  {
    absl::MutexLock lock(&replies.mu);
    for (size_t i = 0; i < sent.size(); ++i) {
      const Frame& f = replies.frames[i];
      EXPECT_EQ(f.header.id(), i + 1);
      c10::IValue v = internal::decode_value(f.header.payload(), f);
      ASSERT_TRUE(v.isTensor());
      EXPECT_TRUE(at::equal(v.toTensor(), sent[i])) << "tensor " << i;
    }
  }
  EXPECT_NE(echo.last_address().find("same-host process"), std::string::npos)
      << echo.last_address();
  ch->close(/*graceful=*/true);
  absl::MutexLock lock(&replies.mu);
  EXPECT_TRUE(replies.ended);
  EXPECT_TRUE(replies.closed.ok) << replies.closed.message;
}

TEST(SameHostTransportTest, OtherHostsGoOverTheFallback) {
  Echo echo;
  PeerOptions options;
  options.self = 1;
  options.same_host_endpoint = "another-host|" + echo.socket_name();
  Replies replies;
  auto ch = echo.transport()->connect(echo.address(), options, replies.on_frame(),
                                      replies.on_close());
  ASSERT_TRUE(ch);
  ASSERT_TRUE(ch->send(request(at::arange(4, at::kFloat), 7), SendOptions{}));
  // gRPC replies are read by a waiter.
  echo.transport()->drive([&] {
    absl::MutexLock lock(&replies.mu);
    return !replies.frames.empty();
  }, absl::Now() + absl::Seconds(20));
  EXPECT_TRUE(replies.wait_for(1));
  EXPECT_EQ(echo.last_address().find("same-host"), std::string::npos)
      << "expected gRPC, got " << echo.last_address();
  ch->close(false);
}

TEST(SameHostTransportTest, WrongTokenIsRefusedByName) {
  Security job;
  job.token = "the job's secret";
  Echo echo(job);
  PeerOptions options;
  options.self = 1;
  options.same_host_endpoint = echo.endpoint();
  options.security.token = "not the secret";
  Replies replies;
  auto ch = echo.transport()->connect(echo.address(), options, replies.on_frame(),
                                      replies.on_close());
  ASSERT_TRUE(ch);
  ch->send(request(at::arange(4, at::kFloat), 1), SendOptions{});
  ASSERT_TRUE(replies.wait_end());
  {
    absl::MutexLock lock(&replies.mu);
    EXPECT_TRUE(replies.frames.empty()) << "a request without the token was served";
    EXPECT_FALSE(replies.closed.ok);
    EXPECT_NE(replies.closed.message.find("wrong job token"), std::string::npos)
        << replies.closed.message;
  }
  ch->close(false);
  // The right token gets in.
  options.security.token = job.token;
  Replies good;
  auto ok = echo.transport()->connect(echo.address(), options, good.on_frame(), good.on_close());
  ok->send(request(at::arange(4, at::kFloat), 2), SendOptions{});
  EXPECT_TRUE(good.wait_for(1));
  ok->close(false);
}

// ---- raw sockets speaking the protocol badly

int raw_connect(const std::string& name) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  socklen_t len = offsetof(sockaddr_un, sun_path) + 1 + name.size();
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{20, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// Reads until the server closes; true if it did (rather than timing out).
bool closed_by_server(int fd) {
  char buf[4096];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET;
  }
}

using same_host::HelloBody;
using same_host::Preamble;

// Best effort: the server may end the connection before all of it is sent
// (it ends one as soon as it sees the fault).
void send_all(int fd, const void* data, size_t n) {
  ssize_t ignored = send(fd, data, n, MSG_NOSIGNAL);
  (void)ignored;
}

void hello(int fd, int worker) {
  Preamble p;
  p.kind = same_host::kHello;
  p.body = sizeof(HelloBody);
  HelloBody h;
  h.worker = worker;
  send_all(fd, &p, sizeof(p));
  send_all(fd, &h, sizeof(h));
}

// A request as the protocol writes it: preamble, head, then (when
// `with_tensor`) the tensor's bytes inline.
std::string raw_request(const at::Tensor& t, uint64_t id, bool with_tensor = true) {
  const std::string head = internal::serialize_head(request(t, id));
  Preamble p;
  p.kind = same_host::kFrame;
  p.body = head.size();
  p.inline_bytes = t.numel() * t.element_size();
  std::string out(reinterpret_cast<const char*>(&p), sizeof(p));
  out += head;
  if (with_tensor) out.append(static_cast<const char*>(t.data_ptr()), p.inline_bytes);
  return out;
}

// Every hostile connection ends; the server still echoes for a good one.
TEST(SameHostTransportTest, HostileConnectionsEndAndTheServerGoesOn) {
  ServerLimits limits;
  limits.max_message_bytes = 1 << 20;
  Echo echo(Security{}, limits);
  const std::string name = echo.socket_name();
  struct Case {
    const char* what;
    std::function<void(int fd)> speak;
  };
  const Frame good = request(at::arange(64 << 10, at::kFloat), 1);
  const std::string head = internal::serialize_head(good);
  std::vector<Case> cases = {
      {"garbage instead of a hello", [](int fd) {
         const std::string garbage(64, 'x');
         send_all(fd, garbage.data(), garbage.size());
       }},
      // Ended by the handshake's timeout (10 s).
      {"a partial hello, then silence", [](int fd) { send_all(fd, "DRPC", 4); }},
      {"a hello naming an unknown worker", [](int fd) { hello(fd, 7); }},
      {"a hello with a huge body claim", [](int fd) {
         Preamble p;
         p.kind = same_host::kHello;
         p.body = 1u << 31;
         send_all(fd, &p, sizeof(p));
       }},
      {"a frame over max_message_bytes", [](int fd) {
         hello(fd, 1);
         Preamble p;
         p.kind = same_host::kFrame;
         p.body = 16;
         p.inline_bytes = uint64_t{1} << 40;
         send_all(fd, &p, sizeof(p));
       }},
      {"a frame whose tensor bytes are fewer than its header says", [&](int fd) {
         hello(fd, 1);
         Preamble p;
         p.kind = same_host::kFrame;
         p.body = head.size();
         p.inline_bytes = 8;
         send_all(fd, &p, sizeof(p));
         send_all(fd, head.data(), head.size());
         send_all(fd, "12345678", 8);
       }},
      {"a remote tensor at an address that is not mapped", [&](int fd) {
         hello(fd, 1);
         Preamble p;
         p.kind = same_host::kFrame;
         p.body = head.size();
         p.num_remote = 1;
         p.remote_bytes = good.tensors[0].numel() * 4;
         uint64_t desc[2] = {0, 16};  // index 0, address 16
         send_all(fd, &p, sizeof(p));
         send_all(fd, head.data(), head.size());
         send_all(fd, desc, sizeof(desc));
       }},
      {"an acknowledgement of nothing", [](int fd) {
         hello(fd, 1);
         Preamble p;
         p.kind = same_host::kAck;
         p.seq = 42;
         send_all(fd, &p, sizeof(p));
       }},
      {"a second hello", [](int fd) {
         hello(fd, 1);
         hello(fd, 1);
       }},
  };
  for (const Case& c : cases) {
    int fd = raw_connect(name);
    ASSERT_GE(fd, 0);
    c.speak(fd);
    EXPECT_TRUE(closed_by_server(fd)) << c.what;
    ::close(fd);
  }
  Replies replies;
  auto ch = connect_as_worker1(&echo, &replies);
  ch->send(request(at::arange(64 << 10, at::kFloat), 9), SendOptions{});
  EXPECT_TRUE(replies.wait_for(1)) << "the server stopped serving after hostile connections";
  ch->close(false);
}

// Reads exactly n bytes (false on a timeout or the end of the stream).
bool recv_all(int fd, void* dst, size_t n) {
  auto* out = static_cast<char*>(dst);
  while (n > 0) {
    ssize_t got = recv(fd, out, n, 0);
    if (got <= 0) return false;
    out += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

// A hello and requests written at once, small ones around one larger than
// what the server reads ahead of its parser and one that straddles the end
// of what it read: every request is answered, in order, with its bytes
// (a server that waited on the socket for bytes it had already read would
// leave the last ones unanswered).
TEST(SameHostTransportTest, RequestsWrittenTogetherAreEachAnswered) {
  Echo echo;
  int fd = raw_connect(echo.socket_name());
  ASSERT_GE(fd, 0);
  std::string burst;
  auto append = [&burst](const void* data, size_t n) {
    burst.append(static_cast<const char*>(data), n);
  };
  Preamble hp;
  hp.kind = same_host::kHello;
  hp.body = sizeof(HelloBody);
  HelloBody h;
  h.worker = 1;
  append(&hp, sizeof(hp));
  append(&h, sizeof(h));
  const std::vector<int64_t> floats = {4, 1, 15000, 4, 40000, 2, 3};
  std::vector<at::Tensor> sent;
  for (size_t i = 0; i < floats.size(); ++i) {
    sent.push_back(at::arange(static_cast<int64_t>(i), static_cast<int64_t>(i) + floats[i], at::kFloat));
    burst += raw_request(sent.back(), i + 1);
  }
  ASSERT_EQ(send(fd, burst.data(), burst.size(), MSG_NOSIGNAL), static_cast<ssize_t>(burst.size()));
  Preamble p;
  ASSERT_TRUE(recv_all(fd, &p, sizeof(p)));
  ASSERT_EQ(p.kind, same_host::kWelcome);
  std::string body(p.body, '\0');
  ASSERT_TRUE(recv_all(fd, body.data(), body.size()));
  for (size_t i = 0; i < floats.size(); ++i) {
    ASSERT_TRUE(recv_all(fd, &p, sizeof(p))) << "no reply to request " << i + 1;
    ASSERT_EQ(p.kind, same_host::kFrame);
    ASSERT_EQ(p.num_remote, 0u);
    ASSERT_EQ(p.inline_bytes, floats[i] * sizeof(float)) << "reply " << i + 1;
    std::string head(p.body, '\0');
    ASSERT_TRUE(recv_all(fd, head.data(), head.size()));
    at::Tensor got = at::empty({floats[i]}, at::kFloat);
    ASSERT_TRUE(recv_all(fd, got.data_ptr(), p.inline_bytes));
    EXPECT_TRUE(at::equal(got, sent[i])) << "reply " << i + 1;
  }
  ::close(fd);
}

// A caller that reads its replies itself (Transport::drive) once they all
// came: its first read takes them together, and each is delivered (a
// reader that polled the socket for those it had already taken would wait
// until its deadline).
TEST(SameHostTransportTest, ACallerReadingItsRepliesGetsThoseThatCameTogether) {
  Echo echo;
  Replies replies;
  auto ch = connect_as_worker1(&echo, &replies);
  ASSERT_TRUE(ch);
  echo.transport()->reserve_reading();
  constexpr int kRequests = 16;
  for (int i = 1; i <= kRequests; ++i) {
    ASSERT_TRUE(ch->send(request(at::arange(4, at::kFloat), i), SendOptions{true, i < kRequests}));
  }
  absl::SleepFor(absl::Milliseconds(300));  // the replies wait in the socket
  auto all = [&] {
    absl::MutexLock lock(&replies.mu);
    return replies.frames.size() >= static_cast<size_t>(kRequests);
  };
  echo.transport()->drive(all, absl::Now() + absl::Seconds(20));
  echo.transport()->release_reading();
  EXPECT_TRUE(all());
  ch->close(/*graceful=*/true);
}

// A caller that never reads its replies stops being read once its replies
// lent and unread pass max_pending_reply_bytes: the server holds a bounded
// amount for it, whatever it sends.
TEST(SameHostTransportTest, ACallerThatDoesNotReadIsThrottled) {
  ServerLimits limits;
  limits.max_pending_reply_bytes = 1 << 20;
  std::atomic<int> served{0};
  auto transport = make_same_host_transport(make_default_transport());
  limits.world_size = 2;
  auto server = transport->listen(
      "127.0.0.1", limits, Security{}, [](int, const Frame&) { return absl::OkStatus(); },
      [&](std::shared_ptr<Responder> r, Frame f) {
        ++served;
        Echo::reply(r, std::move(f));
      },
      [&](std::shared_ptr<Responder> r, Frame f) {
        ++served;
        Echo::reply(r, std::move(f));
      });
  const std::string ep = server->same_host_endpoint();
  int fd = raw_connect(ep.substr(ep.rfind('|') + 1));
  hello(fd, 1);
  // 64 requests of 256 KiB, inline; the caller never reads a reply.
  const Frame f = request(at::arange(64 << 10, at::kFloat), 1);
  const std::string head = internal::serialize_head(f);
  std::string msg(sizeof(Preamble), '\0');
  Preamble p;
  p.kind = same_host::kFrame;
  p.body = head.size();
  p.inline_bytes = 256 << 10;
  std::memcpy(msg.data(), &p, sizeof(p));
  msg += head;
  msg.append(static_cast<const char*>(f.tensors[0].data_ptr()), 256 << 10);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (int i = 0; i < 64 && !stop; ++i) {
      size_t off = 0;
      while (off < msg.size() && !stop) {
        ssize_t n = send(fd, msg.data() + off, msg.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) off += n;
        else usleep(1000);
      }
    }
  });
  absl::SleepFor(absl::Seconds(2));
  stop = true;
  writer.join();
  // Replies the socket holds plus 1 MiB queued, plus what was read but
  // not answered: far below 64 requests.
  EXPECT_GT(served.load(), 0);
  EXPECT_LT(served.load(), 32) << "the server kept reading a caller that reads nothing";
  ::close(fd);
  server->shutdown(absl::ZeroDuration());
}

// A request that blocks its connection's reading thread, run after the
// server has been idle long enough for its watchdog to stop ticking: the
// watchdog still hands reading on, so the next request (which releases the
// first) is read. Twice, with a pause before each.
TEST(SameHostTransportTest, ABlockedRequestAfterAnIdlePauseIsHandedOn) {
  ServerLimits limits;
  limits.world_size = 2;
  limits.inline_handoff = absl::Milliseconds(10);
  auto transport = make_same_host_transport(make_default_transport());
  absl::Mutex mu;
  int released ABSL_GUARDED_BY(mu) = 0;  // requests that released a blocked one
  auto serve = [&](std::shared_ptr<Responder> r, Frame f) {
    const uint64_t id = f.header.id();
    if (id % 2 == 1) {  // blocks until the next request arrives
      absl::MutexLock lock(&mu);
      auto next_came = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
        return released >= static_cast<int>(id / 2) + 1;
      };
      mu.AwaitWithTimeout(absl::Condition(&next_came), absl::Seconds(20));
    } else {
      absl::MutexLock lock(&mu);
      ++released;
    }
    Echo::reply(r, std::move(f));
  };
  auto server = transport->listen(
      "127.0.0.1", limits, Security{}, [](int, const Frame&) { return absl::OkStatus(); }, serve,
      serve);
  Replies replies;
  PeerOptions options;
  options.self = 1;
  options.same_host_endpoint = server->same_host_endpoint();
  auto ch = transport->connect("127.0.0.1:" + std::to_string(server->port()), options,
                               replies.on_frame(), replies.on_close());
  ASSERT_TRUE(ch);
  for (uint64_t round = 0; round < 2; ++round) {
    absl::SleepFor(absl::Milliseconds(400));  // the watchdog parks after 100 ms
    const absl::Time start = absl::Now();
    // Neither says that others are in flight: both are run inline.
    ASSERT_TRUE(ch->send(request(at::arange(4, at::kFloat), 2 * round + 1), SendOptions{}));
    ASSERT_TRUE(ch->send(request(at::arange(4, at::kFloat), 2 * round + 2), SendOptions{}));
    ASSERT_TRUE(replies.wait_for(2 * round + 2)) << "round " << round;
    EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "round " << round;
    absl::MutexLock lock(&mu);
    EXPECT_EQ(released, static_cast<int>(round) + 1);
  }
  ch->close(/*graceful=*/true);
  server->shutdown(absl::ZeroDuration());
}


// A server whose requests (inline or handed on) go to `handler`, and
// channels to it as workers 1, 2, ...
class Served {
 public:
  using Handler = std::function<void(std::shared_ptr<Responder>, Frame)>;
  Served(ServerLimits limits, Handler handler) : handler_(std::move(handler)) {
    limits.world_size = 8;
    transport_ = make_same_host_transport(make_default_transport());
    server_ = transport_->listen(
        "127.0.0.1", limits, Security{}, [](int, const Frame&) { return absl::OkStatus(); },
        [this](std::shared_ptr<Responder> r, Frame f) { handler_(std::move(r), std::move(f)); },
        [this](std::shared_ptr<Responder> r, Frame f) { handler_(std::move(r), std::move(f)); });
  }
  ~Served() {
    for (auto& ch : channels_) ch->close(/*graceful=*/false);
    server_->shutdown(absl::ZeroDuration());
  }
  Channel* connect(int worker, Replies* replies) {
    PeerOptions options;
    options.self = worker;
    options.same_host_endpoint = server_->same_host_endpoint();
    channels_.push_back(transport_->connect("127.0.0.1:" + std::to_string(server_->port()),
                                            options, replies->on_frame(), replies->on_close()));
    return channels_.back().get();
  }
  std::string socket_name() const {
    const std::string ep = server_->same_host_endpoint();
    return ep.substr(ep.rfind('|') + 1);
  }
  std::string endpoint() const { return server_->same_host_endpoint(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(server_->port()); }

 private:
  const Handler handler_;
  std::shared_ptr<Transport> transport_;
  std::unique_ptr<Server> server_;
  std::vector<std::shared_ptr<Channel>> channels_;
};

// The requests of several callers are run by the thread that holds the
// server's reading role, one after another, not by a thread per
// connection: requests that come while it is busy cost no other thread's
// wake-up.
TEST(SameHostTransportTest, RequestsOfSeveralCallersRunOnTheReadingThread) {
  ServerLimits limits;
  limits.inline_handoff = absl::Minutes(10);  // the role never moves here
  absl::Mutex mu;
  std::set<std::thread::id> threads;
  Served server(limits, [&](std::shared_ptr<Responder> r, Frame f) {
    {
      absl::MutexLock lock(&mu);
      threads.insert(std::this_thread::get_id());
    }
    absl::SleepFor(absl::Milliseconds(1));  // others' requests come meanwhile
    Echo::reply(r, std::move(f));
  });
  Replies replies[3];
  std::vector<Channel*> channels;
  for (int w = 0; w < 3; ++w) channels.push_back(server.connect(w + 1, &replies[w]));
  for (int round = 1; round <= 5; ++round) {
    for (Channel* ch : channels) {
      ASSERT_TRUE(ch->send(request(at::arange(4, at::kFloat), round), SendOptions{}));
    }
    for (Replies& r : replies) ASSERT_TRUE(r.wait_for(round));
  }
  absl::MutexLock lock(&mu);
  EXPECT_EQ(threads.size(), 1u) << "requests of different callers ran on different threads";
}

// A request that blocks gives the reading role away (after inline_handoff):
// another caller's request, which releases it, is read and run.
TEST(SameHostTransportTest, ARequestThatBlocksLetsOtherCallersIn) {
  ServerLimits limits;
  limits.inline_handoff = absl::Milliseconds(10);
  absl::Notification blocked, released;
  Served server(limits, [&](std::shared_ptr<Responder> r, Frame f) {
    if (f.header.id() == 1) {
      blocked.Notify();
      released.WaitForNotificationWithTimeout(absl::Seconds(20));
    } else {
      released.Notify();
    }
    Echo::reply(r, std::move(f));
  });
  Replies first, second;
  Channel* a = server.connect(1, &first);
  Channel* b = server.connect(2, &second);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(a->send(request(at::arange(4, at::kFloat), 1), SendOptions{}));
  ASSERT_TRUE(blocked.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(b->send(request(at::arange(4, at::kFloat), 2), SendOptions{}));
  ASSERT_TRUE(second.wait_for(1));
  ASSERT_TRUE(first.wait_for(1));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "the blocked request kept the role";
}

// A caller that stops halfway through a frame (and stays connected) keeps
// only its own connection: the others are still answered.
TEST(SameHostTransportTest, AFrameLeftHalfwayDoesNotStopTheOthers) {
  ServerLimits limits;
  limits.inline_handoff = absl::Milliseconds(10);
  Served server(limits, [](std::shared_ptr<Responder> r, Frame f) { Echo::reply(r, std::move(f)); });
  int fd = raw_connect(server.socket_name());
  ASSERT_GE(fd, 0);
  hello(fd, 3);
  const std::string half = raw_request(at::arange(64, at::kFloat), 1, /*with_tensor=*/false);
  send_all(fd, half.data(), half.size());  // and none of its tensor bytes
  absl::SleepFor(absl::Milliseconds(50));
  Replies replies;
  Channel* ch = server.connect(1, &replies);
  for (int i = 1; i <= 3; ++i) {
    const absl::Time start = absl::Now();
    ASSERT_TRUE(ch->send(request(at::arange(4, at::kFloat), i), SendOptions{}));
    ASSERT_TRUE(replies.wait_for(i)) << "request " << i;
    EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "request " << i;
  }
  ::close(fd);
}

// Limits under which a message's bytes may pause 1.8 s (6 x
// keepalive_timeout).
ServerLimits short_silence() {
  ServerLimits limits;
  limits.inline_handoff = absl::Milliseconds(10);
  limits.keepalive_interval = absl::Milliseconds(100);
  limits.keepalive_timeout = absl::Milliseconds(300);
  return limits;
}

// A live caller that stops in the middle of a frame loses its connection
// once it has been silent for 6 x keepalive_timeout: the thread reading it
// is not held for good.
TEST(SameHostTransportTest, AFrameLeftHalfwayEndsItsConnectionAfterTheSilenceLimit) {
  Served server(short_silence(), [](std::shared_ptr<Responder> r, Frame f) {
    Echo::reply(r, std::move(f));
  });
  int fd = raw_connect(server.socket_name());
  ASSERT_GE(fd, 0);
  hello(fd, 3);
  const std::string half = raw_request(at::arange(64, at::kFloat), 1, /*with_tensor=*/false);
  const absl::Time start = absl::Now();
  send_all(fd, half.data(), half.size());  // and none of its tensor bytes
  // The server's end: whatever it says, then end of stream.
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[4096];
  ssize_t got;
  while ((got = ::recv(fd, buf, sizeof(buf), 0)) > 0) {
  }
  EXPECT_EQ(got, 0) << "the connection is still open after " << absl::Now() - start;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ::close(fd);
}

// The same for a message whose bytes trickle in, each within the silence
// limit of the one before: it must still come whole within the limit plus
// its bytes at the least rate.
TEST(SameHostTransportTest, AFrameTrickledAByteAtATimeEndsItsConnection) {
  Served server(short_silence(), [](std::shared_ptr<Responder> r, Frame f) {
    Echo::reply(r, std::move(f));
  });
  int fd = raw_connect(server.socket_name());
  ASSERT_GE(fd, 0);
  hello(fd, 3);
  const std::string whole = raw_request(at::arange(64, at::kFloat), 1);
  const std::string half = raw_request(at::arange(64, at::kFloat), 1, /*with_tensor=*/false);
  ASSERT_GT(whole.size(), half.size());
  const absl::Time start = absl::Now();
  send_all(fd, half.data(), half.size());
  absl::Duration closed_after = absl::InfiniteDuration();
  for (size_t i = half.size(); i < whole.size() && absl::Now() - start < absl::Seconds(15); ++i) {
    char c;
    const ssize_t got = ::recv(fd, &c, 1, MSG_DONTWAIT);
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
      closed_after = absl::Now() - start;
      break;
    }
    if (::send(fd, whole.data() + i, 1, MSG_NOSIGNAL) != 1) {
      closed_after = absl::Now() - start;
      break;
    }
    absl::SleepFor(absl::Milliseconds(500));
  }
  EXPECT_LT(closed_after, absl::Seconds(5)) << "the trickled message held its connection";
  ::close(fd);
}

// A caller that keeps its connection full of requests does not starve
// another: the server serves a share of one connection, then the others
// that have bytes, in turn.
TEST(SameHostTransportTest, AFloodingCallerDoesNotStarveAnother) {
  std::atomic<int> flood_served{0};
  Served server(ServerLimits{}, [&](std::shared_ptr<Responder> r, Frame f) {
    if (f.header.id() != 0) ++flood_served;
    Echo::reply(r, std::move(f));
  });
  int fd = raw_connect(server.socket_name());
  ASSERT_GE(fd, 0);
  hello(fd, 3);
  const std::string msg = raw_request(at::arange(4, at::kFloat), 1);
  constexpr int kFlood = 20000;
  std::string burst;
  for (int i = 0; i < 100; ++i) burst += msg;
  // Replies are read (and dropped) so that the flood is never throttled.
  std::thread drain([fd] {
    char buf[1 << 16];
    while (recv(fd, buf, sizeof(buf), 0) > 0) {
    }
  });
  std::thread flood([&] {
    for (int i = 0; i < kFlood / 100; ++i) send_all(fd, burst.data(), burst.size());
  });
  while (flood_served.load() < 100) absl::SleepFor(absl::Milliseconds(1));
  Replies replies;
  Channel* ch = server.connect(1, &replies);
  ASSERT_TRUE(ch->send(request(at::arange(4, at::kFloat), 0), SendOptions{}));
  ASSERT_TRUE(replies.wait_for(1));
  EXPECT_LT(flood_served.load(), kFlood) << "the other caller was answered after the whole flood";
  flood.join();
  ::shutdown(fd, SHUT_RDWR);
  drain.join();
  ::close(fd);
}


// A thread waiting for a reply (drive) keeps the reading roles it took
// until its wait ends, but lets go of a channel that another thread
// closes: the close does not wait for the awaited reply.
TEST(SameHostTransportTest, ClosingAChannelThatAWaitingThreadReadsReturnsAtOnce) {
  absl::Notification release;
  Served slow(ServerLimits{}, [&](std::shared_ptr<Responder> r, Frame f) {
    if (f.header.id() == 2) release.WaitForNotificationWithTimeout(absl::Seconds(20));
    Echo::reply(r, std::move(f));
  });
  Served quick(ServerLimits{}, [](std::shared_ptr<Responder> r, Frame f) {
    Echo::reply(r, std::move(f));
  });
  auto client = make_same_host_transport(make_default_transport());
  auto open = [&](const Served& server, Replies* replies) {
    PeerOptions options;
    options.self = 1;
    options.same_host_endpoint = server.endpoint();
    return client->connect(server.address(), options, replies->on_frame(), replies->on_close());
  };
  Replies slow_replies, quick_replies;
  std::shared_ptr<Channel> to_slow = open(slow, &slow_replies);
  std::shared_ptr<Channel> to_quick = open(quick, &quick_replies);
  // Both welcomed, so that a waiting thread takes both roles.
  ASSERT_TRUE(to_slow->send(request(at::arange(4, at::kFloat), 1), SendOptions{}));
  ASSERT_TRUE(to_quick->send(request(at::arange(4, at::kFloat), 1), SendOptions{}));
  ASSERT_TRUE(slow_replies.wait_for(1));
  ASSERT_TRUE(quick_replies.wait_for(1));
  ASSERT_TRUE(to_slow->send(request(at::arange(4, at::kFloat), 2), SendOptions{}));
  std::thread waiter([&] {
    client->drive(
        [&] {
          absl::MutexLock lock(&slow_replies.mu);
          return slow_replies.frames.size() >= 2;
        },
        absl::Now() + absl::Seconds(30));
  });
  absl::SleepFor(absl::Milliseconds(200));  // the waiter holds both roles
  const absl::Time start = absl::Now();
  to_quick->close(/*graceful=*/false);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "close waited for the other reply";
  release.Notify();
  waiter.join();
  {
    absl::MutexLock lock(&slow_replies.mu);
    EXPECT_EQ(slow_replies.frames.size(), 2u);
  }
  to_slow->close(/*graceful=*/false);
}


// A reply larger than max_pending_reply_bytes is lent by address as any
// other; the caller's acknowledgement of it is read, so the connection goes
// on: the next calls on it are answered (a server that stopped reading
// until lent bytes were acknowledged never read that acknowledgement).
// Several large replies at once are lent while within the limit and sent
// inline beyond it.
TEST(SameHostTransportTest, RepliesLargerThanTheReplyLimitLeaveTheConnectionGoing) {
  ServerLimits limits;
  limits.max_pending_reply_bytes = 1 << 20;
  Served server(limits, [](std::shared_ptr<Responder> r, Frame f) { Echo::reply(r, std::move(f)); });
  Replies replies;
  Channel* ch = server.connect(1, &replies);
  const at::Tensor big = at::arange(1 << 20, at::kFloat);  // 4 MiB
  ASSERT_TRUE(ch->send(request(big, 1), SendOptions{}));
  ASSERT_TRUE(replies.wait_for(1));
  const absl::Time start = absl::Now();
  ASSERT_TRUE(ch->send(request(at::arange(4, at::kFloat), 2), SendOptions{}));
  ASSERT_TRUE(replies.wait_for(2)) << "the call after a large reply was not answered";
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  for (uint64_t id = 3; id <= 6; ++id) {
    ASSERT_TRUE(ch->send(request(big, id), SendOptions{true, id < 6}));
  }
  ASSERT_TRUE(replies.wait_for(6));
  absl::MutexLock lock(&replies.mu);
  for (size_t i = 2; i < 6; ++i) {
    c10::IValue v = internal::decode_value(replies.frames[i].header.payload(), replies.frames[i]);
    EXPECT_TRUE(at::equal(v.toTensor(), big)) << "reply " << i + 1;
  }
}

// Requests that run about as long as inline_handoff, so that the watchdog
// often takes the role just as one ends: every request of every caller is
// answered once, with its own bytes, and the connections go on.
TEST(SameHostTransportTest, RequestsAsLongAsTheHandoffAreEachAnsweredOnce) {
  ServerLimits limits;
  limits.inline_handoff = absl::Milliseconds(5);
  std::atomic<int> runs{0};
  Served server(limits, [&](std::shared_ptr<Responder> r, Frame f) {
    ++runs;
    absl::SleepFor(absl::Microseconds(4500 + 100 * (f.header.id() % 10)));
    Echo::reply(r, std::move(f));
  });
  constexpr int kCallers = 3;
  constexpr int kEach = 60;
  Replies replies[kCallers];
  std::vector<std::thread> callers;
  std::atomic<bool> sent_all{true};
  for (int w = 0; w < kCallers; ++w) {
    Channel* ch = server.connect(w + 1, &replies[w]);
    callers.emplace_back([&, ch, w] {
      for (int i = 1; i <= kEach; ++i) {
        if (!ch->send(request(at::full({4}, w * 1000 + i), i), SendOptions{})) sent_all = false;
        if (!replies[w].wait_for(i)) return;
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_TRUE(sent_all.load());
  EXPECT_EQ(runs.load(), kCallers * kEach);
  for (int w = 0; w < kCallers; ++w) {
    absl::MutexLock lock(&replies[w].mu);
    ASSERT_EQ(replies[w].frames.size(), static_cast<size_t>(kEach)) << "caller " << w + 1;
    EXPECT_FALSE(replies[w].ended) << replies[w].closed.message;
    for (int i = 0; i < kEach; ++i) {
      const Frame& f = replies[w].frames[i];
      EXPECT_EQ(f.header.id(), static_cast<uint64_t>(i + 1));
      c10::IValue v = internal::decode_value(f.header.payload(), f);
      EXPECT_TRUE(at::equal(v.toTensor(), at::full({4}, w * 1000 + i + 1)));
    }
  }
}

}  // namespace
}  // namespace ddprpc::rpc::transport

namespace ddprpc::rpc::transport {
namespace {

// The warnings logged while it lives that contain `needle`.
class WarningsAbout : public google::LogSink {
 public:
  explicit WarningsAbout(std::string needle) : needle_(std::move(needle)) {
    google::AddLogSink(this);
  }
  ~WarningsAbout() override { google::RemoveLogSink(this); }
  void send(google::LogSeverity severity, const char*, const char*, int, const struct ::tm*,
            const char* message, size_t message_len) override {
    const std::string m(message, message_len);
    if (severity >= google::GLOG_WARNING && m.find(needle_) != std::string::npos) {
      absl::MutexLock lock(&mu_);
      seen_.push_back(m);
    }
  }
  std::vector<std::string> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  const std::string needle_;
  absl::Mutex mu_;
  std::vector<std::string> seen_ ABSL_GUARDED_BY(mu_);
};

// A caller that closes its end while its request runs (it exited, or
// closed its channel) ends like one that closes between requests: the reply
// that finds it gone ends the connection without a warning, and the server
// goes on.
TEST(SameHostTransportTest, ACallerThatClosesBeforeItsReplyEndsWithoutAWarning) {
  ServerLimits limits;
  limits.inline_handoff = absl::Minutes(10);  // the request runs on the reading thread
  absl::Notification started, release;
  Served server(limits, [&](std::shared_ptr<Responder> r, Frame f) {
    if (!started.HasBeenNotified()) {
      started.Notify();
      release.WaitForNotificationWithTimeout(absl::Seconds(20));
    }
    Echo::reply(r, std::move(f));
  });
  WarningsAbout warnings("ending the connection");
  int fd = raw_connect(server.socket_name());
  ASSERT_GE(fd, 0);
  hello(fd, 1);
  Preamble p;
  ASSERT_TRUE(recv_all(fd, &p, sizeof(p)));
  ASSERT_EQ(p.kind, same_host::kWelcome);
  std::string body(p.body, '\0');
  ASSERT_TRUE(recv_all(fd, body.data(), body.size()));
  const std::string req = raw_request(at::arange(4, at::kFloat), 1);
  send_all(fd, req.data(), req.size());
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ::close(fd);
  release.Notify();  // its reply now finds the caller gone
  // The same reading thread then serves another caller.
  Replies replies;
  Channel* ch = server.connect(2, &replies);
  ASSERT_TRUE(ch->send(request(at::arange(3, at::kFloat), 1), SendOptions{}));
  ASSERT_TRUE(replies.wait_for(1));
  EXPECT_TRUE(warnings.seen().empty()) << warnings.seen()[0];
}

// ---- strangers: other users, silent connections, descriptors running out

int count_entries(const char* dir) {
  DIR* d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n;
}

// The abstract address of a server's socket, made before a fork: the child
// then only makes system calls.
struct RawAddress {
  explicit RawAddress(const std::string& name) {
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    len = offsetof(sockaddr_un, sun_path) + 1 + name.size();
  }
  int connect_blocking() const {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
      ::close(fd);
      return -1;
    }
    return fd;
  }
  sockaddr_un addr{};
  socklen_t len = 0;
};

// Whether the server has closed `fd` (its end shows, nothing read stays).
bool server_closed_now(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  char c;
  return recv(fd, &c, 1, MSG_DONTWAIT | MSG_PEEK) == 0;
}

// A process of another user (uid `nobody`) that connects and says a valid
// hello: 0 when the server closed without a byte, 1 when it welcomed it,
// 2 when it refused it with a welcome, 3 otherwise.
int hello_as_another_user(const RawAddress& address) {
  const passwd* nobody = getpwnam("nobody");
  if (!nobody) return -1;
  const uid_t uid = nobody->pw_uid;
  const gid_t gid = nobody->pw_gid;
  const pid_t child = fork();
  if (child == 0) {
    alarm(20);
    if (setgroups(0, nullptr) != 0 || setgid(gid) != 0 || setuid(uid) != 0) _exit(4);
    const int fd = address.connect_blocking();
    if (fd < 0) _exit(5);
    Preamble p;
    p.kind = same_host::kHello;
    p.body = sizeof(HelloBody);
    HelloBody h;
    h.worker = 1;
    if (send(fd, &p, sizeof(p), MSG_NOSIGNAL) < 0) _exit(0);
    if (send(fd, &h, sizeof(h), MSG_NOSIGNAL) < 0) _exit(0);
    Preamble w;
    const ssize_t n = recv(fd, &w, sizeof(w), MSG_WAITALL);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) _exit(0);
    if (n != sizeof(w) || w.kind != same_host::kWelcome) _exit(3);
    same_host::WelcomeBody body;
    if (recv(fd, &body, sizeof(body), MSG_WAITALL) != sizeof(body)) _exit(3);
    _exit(body.code == 0 ? 1 : 2);
  }
  int status = 0;
  if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// A process of another uid is refused as it connects, before its hello is
// read, unless the server allows other uids.
TEST(SameHostTransportTest, AnotherUserIsRefusedBeforeItsHelloUnlessAllowed) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a process as another user";
  {
    Echo echo;
    EXPECT_EQ(hello_as_another_user(RawAddress(echo.socket_name())), 0)
        << "a process of another uid was not closed at once";
    // The job's own processes still get in.
    Replies replies;
    auto ch = connect_as_worker1(&echo, &replies);
    ch->send(request(at::arange(4, at::kFloat), 1), SendOptions{});
    EXPECT_TRUE(replies.wait_for(1));
    ch->close(false);
  }
  ServerLimits allow;
  allow.allow_other_uids = true;
  Echo echo(Security{}, allow);
  EXPECT_EQ(hello_as_another_user(RawAddress(echo.socket_name())), 1);
}

// Connections that never say hello take no thread each, and past the caps
// the oldest of them are closed: the job's own connection still gets in
// and is served within a second.
TEST(SameHostTransportTest, SilentConnectionsTakeNoThreadAndCannotKeepTheJobOut) {
  ServerLimits limits;
  limits.max_unauthenticated_connections = 8;
  limits.max_unauthenticated_per_peer = 4;
  Echo echo(Security{}, limits);
  const RawAddress address(echo.socket_name());
  const int threads_before = count_entries("/proc/self/task");
  std::vector<int> silent;
  for (int i = 0; i < 200; ++i) {
    const int fd = address.connect_blocking();
    ASSERT_GE(fd, 0);
    silent.push_back(fd);
  }
  // The server takes them all, then holds no more than its cap.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  int still_open = 0;
  do {
    absl::SleepFor(absl::Milliseconds(20));
    still_open = 0;
    for (int fd : silent) still_open += server_closed_now(fd) ? 0 : 1;
  } while (still_open > limits.max_unauthenticated_per_peer && absl::Now() < deadline);
  EXPECT_LE(still_open, limits.max_unauthenticated_per_peer);
  EXPECT_LT(count_entries("/proc/self/task") - threads_before, 8)
      << "silent connections cost a thread each";
  const absl::Time start = absl::Now();
  Replies replies;
  auto ch = connect_as_worker1(&echo, &replies);
  ch->send(request(at::arange(4, at::kFloat), 1), SendOptions{});
  EXPECT_TRUE(replies.wait_for(1));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  ch->close(false);
  for (int fd : silent) ::close(fd);
}

// A caller of another process floods the server's socket while the
// server's process has few descriptors left: connections it cannot take
// fail alone; the job's open channel (whose liveness checks read /proc)
// keeps being served, each call within a second; once the flood ends a new
// channel is served again.
TEST(SameHostTransportTest, RunningOutOfDescriptorsFailsOnlyTheNewConnections) {
  ServerLimits limits;
  limits.max_unauthenticated_connections = 1 << 20;  // descriptors run out first
  limits.max_unauthenticated_per_peer = 1 << 20;
  limits.keepalive_interval = absl::Milliseconds(20);  // the server looks at /proc often
  Echo echo(Security{}, limits);
  PeerOptions options;
  options.self = 1;
  options.same_host_endpoint = echo.endpoint();
  options.keepalive_interval = absl::Milliseconds(20);  // looks at /proc often
  Replies replies;
  auto ch = echo.transport()->connect(echo.address(), options, replies.on_frame(),
                                      replies.on_close());
  uint64_t id = 0;
  ASSERT_TRUE(ch->send(request(at::arange(4, at::kFloat), ++id), SendOptions{}));
  ASSERT_TRUE(replies.wait_for(id));

  const RawAddress address(echo.socket_name());
  int ready[2], release[2];
  ASSERT_EQ(pipe2(ready, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(release, O_CLOEXEC), 0);
  rlimit old_limit{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old_limit), 0);
  rlimit low = old_limit;
  low.rlim_cur = count_entries("/proc/self/fd") + 32;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  auto restore = absl::MakeCleanup([&] { setrlimit(RLIMIT_NOFILE, &old_limit); });
  const pid_t child = fork();
  if (child == 0) {
    alarm(30);
    ::close(release[1]);
    ::close(ready[0]);
    setrlimit(RLIMIT_NOFILE, &old_limit);
    int opened = 0;
    for (int i = 0; i < 400; ++i) opened += address.connect_blocking() >= 0 ? 1 : 0;
    char c = static_cast<char>(opened > 0);
    ssize_t ignored = write(ready[1], &c, 1);
    (void)ignored;
    ignored = read(release[0], &c, 1);  // until the parent closes it
    _exit(0);
  }
  ASSERT_GT(child, 0);
  ::close(ready[1]);
  ::close(release[0]);
  auto end_child = absl::MakeCleanup([&] {
    if (release[1] >= 0) ::close(release[1]);
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
  });
  char opened = 0;
  ASSERT_EQ(read(ready[0], &opened, 1), 1);
  EXPECT_EQ(opened, 1);
  // The process is full once opening a directory fails. Fullness comes and
  // goes (the server frees its reserve descriptor to shed a connection), so
  // seeing it once is what counts.
  const absl::Time full_by = absl::Now() + absl::Seconds(5);
  bool full = false;
  while (!full && absl::Now() < full_by) {
    full = count_entries("/proc/self/fd") < 0;
    if (!full) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(full) << "the server's process never ran out of descriptors";
  // Calls on the open channel, for a while, each within a second.
  const absl::Time until = absl::Now() + absl::Milliseconds(600);
  while (absl::Now() < until) {
    const absl::Time start = absl::Now();
    ASSERT_TRUE(ch->send(request(at::arange(4, at::kFloat), ++id), SendOptions{}))
        << "the channel ended during the flood";
    ASSERT_TRUE(replies.wait_for(id));
    EXPECT_LT(absl::Now() - start, absl::Seconds(1));
    absl::SleepFor(absl::Milliseconds(30));
    ch->check_connection();  // what the agent does for idle channels
  }
  {
    absl::MutexLock lock(&replies.mu);
    EXPECT_FALSE(replies.ended) << replies.closed.message;
  }
  // The flood ends: its connections close and a new channel is served.
  ::close(release[1]);
  release[1] = -1;
  ::close(ready[0]);
  const absl::Time start = absl::Now();
  // The server lets the flood's descriptors go as its connections close
  // (a connection tried before then would go over gRPC, which takes
  // descriptors of its own).
  int free_fds = 0;
  while (absl::Now() - start < absl::Seconds(5)) {
    const int used = count_entries("/proc/self/fd");
    free_fds = used < 0 ? 0 : static_cast<int>(low.rlim_cur) - used;
    if (free_fds >= 8) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_GE(free_fds, 8) << "the server kept the flood's descriptors";
  Replies again;
  auto fresh = echo.transport()->connect(echo.address(), options, again.on_frame(),
                                         again.on_close());
  ASSERT_TRUE(fresh->send(request(at::arange(4, at::kFloat), 1), SendOptions{}));
  ASSERT_TRUE(again.wait_for(1));
  const absl::Duration recovery = absl::Now() - start;
  LOG(INFO) << "a new channel was served " << recovery << " after the flood ended";
  EXPECT_LT(recovery, absl::Seconds(1));
  EXPECT_EQ(echo.last_address().rfind("same-host", 0), 0u) << echo.last_address();
  fresh->close(false);
  ch->close(false);
}

// ---- strangers on the gRPC port

int port_of(const std::string& address) { return std::stoi(address.substr(address.rfind(':') + 1)); }

// Streams without the job's proof from a stranger's connections for
// `duration`, each connection keeping `streams` of them open (the server
// ends them; they are opened again), each sending the start of a message.
// Returns the bytes the server's windows let through.
size_t stranger_flood(int port, int connections, int streams, absl::Duration duration) {
  std::vector<std::unique_ptr<testing::RawHttp2>> conns;
  for (int i = 0; i < connections; ++i) {
    auto c = std::make_unique<testing::RawHttp2>();
    if (c->connect(port)) conns.push_back(std::move(c));
  }
  const absl::Time deadline = absl::Now() + duration;
  while (absl::Now() < deadline) {
    for (auto& c : conns) {
      if (c->closed()) {
        c = std::make_unique<testing::RawHttp2>();
        if (!c->connect(port)) continue;
      }
      while (c->open_streams() < streams) {
        c->send_partial_message(c->open_call("/ddprpc.Transport/Stream", {{rpc::internal::kWorkerMetadataKey, "1"}}),
                                64 << 20, 16 << 20);
      }
      c->pump(absl::Milliseconds(1));
    }
  }
  size_t sent = 0;
  for (auto& c : conns) sent += c->sent_body_bytes();
  return sent;
}

// On the gRPC port, a stream without the job's proof ends as its metadata
// arrives, before the server reads what it sends; after a flood of such
// streams, which leaves the worker's memory within bounds, a channel of
// the job is served within a second.
TEST(SameHostTransportTest, StrangersOnTheGrpcPortEndBeforeTheyAreReadAndThePortServesAgain) {
  Security job;
  job.token = "the job's secret";
  ServerLimits limits;
  limits.max_buffered_bytes = 32 << 20;
  Echo echo(job, limits);
  const int port = port_of(echo.address());
  {
    testing::RawHttp2 raw;
    ASSERT_TRUE(raw.connect(port));
    const uint32_t call = raw.open_call("/ddprpc.Transport/Stream", {{rpc::internal::kWorkerMetadataKey, "1"}});
    raw.send_partial_message(call, 64 << 20, 16 << 20);
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (!raw.ended(call) && !raw.closed() && absl::Now() < deadline) {
      raw.pump(absl::Milliseconds(20));
    }
    EXPECT_TRUE(raw.ended(call) || raw.closed()) << "the stranger's stream is still open";
    LOG(INFO) << "a stranger's stream got " << raw.sent_body_bytes() << " bytes through";
    EXPECT_LE(raw.sent_body_bytes(), size_t{1} << 20);
  }
  int sent_pipe[2];
  ASSERT_EQ(pipe2(sent_pipe, O_CLOEXEC), 0);
  const int64_t before = testing::resident_bytes();
  const pid_t child = fork();
  if (child == 0) {
    alarm(30);
    ::close(sent_pipe[0]);
    const uint64_t sent = stranger_flood(port, 32, 4, absl::Seconds(2));
    ssize_t ignored = write(sent_pipe[1], &sent, sizeof(sent));
    (void)ignored;
    _exit(0);
  }
  ASSERT_GT(child, 0);
  ::close(sent_pipe[1]);
  int64_t peak = before;
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (waitpid(child, nullptr, WNOHANG) == 0) {
    peak = std::max(peak, testing::resident_bytes());
    if (absl::Now() > until) {
      kill(child, SIGKILL);
      waitpid(child, nullptr, 0);
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  uint64_t sent = 0;
  EXPECT_EQ(read(sent_pipe[0], &sent, sizeof(sent)), static_cast<ssize_t>(sizeof(sent)));
  ::close(sent_pipe[0]);
  LOG(INFO) << "stranger flood on the gRPC port: " << (sent >> 20)
            << " MiB got through; the worker's memory grew by " << ((peak - before) >> 20)
            << " MiB at most";
  // gRPC's quota is a pressure rather than a wall: a few times its size.
  EXPECT_LT(peak - before, int64_t{128} << 20);
  const absl::Time start = absl::Now();
  PeerOptions options;
  options.self = 1;
  options.security = job;
  Replies replies;
  auto ch = echo.transport()->connect(echo.address(), options, replies.on_frame(),
                                      replies.on_close());
  ASSERT_TRUE(ch);
  ASSERT_TRUE(ch->send(request(at::arange(4, at::kFloat), 1), SendOptions{}));
  echo.transport()->drive([&] {
    absl::MutexLock lock(&replies.mu);
    return !replies.frames.empty() || replies.ended;
  }, absl::Now() + absl::Seconds(20));
  EXPECT_TRUE(replies.wait_for(1));
  LOG(INFO) << "the gRPC port served a channel " << absl::Now() - start << " after the flood";
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  ch->close(false);
}

// ---- members

// With its slots full, a worker's newest connection replaces its oldest:
// connections left behind, or opened by another holder of the token in its
// name, cannot keep the worker out.
TEST(SameHostTransportTest, AWorkersNewestConnectionReplacesItsOldest) {
  ServerLimits limits;
  limits.max_streams_per_worker = 1;
  Echo echo(Security{}, limits);
  Replies first;
  auto a = connect_as_worker1(&echo, &first);
  ASSERT_TRUE(a->send(request(at::arange(4, at::kFloat), 1), SendOptions{}));
  ASSERT_TRUE(first.wait_for(1));
  Replies second;
  auto b = connect_as_worker1(&echo, &second);
  ASSERT_TRUE(b->send(request(at::arange(4, at::kFloat), 1), SendOptions{}));
  EXPECT_TRUE(second.wait_for(1)) << "the newer connection was refused";
  // An idle channel learns of its end when the agent checks it.
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (!a->broken() && absl::Now() < until) {
    a->check_connection();
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(first.wait_end()) << "the older connection is still open";
  {
    absl::MutexLock lock(&first.mu);
    EXPECT_NE(first.closed.message.find("replaced"), std::string::npos) << first.closed.message;
  }
  b->close(false);
  a->close(false);
}

// A frame whose sizes add up past 2^64 is refused as such, not as a frame
// of the few bytes its sum wraps to.
TEST(SameHostTransportTest, AFrameWhoseSizesOverflowSaysSo) {
  Echo echo;
  int fd = raw_connect(echo.socket_name());
  ASSERT_GE(fd, 0);
  hello(fd, 1);
  Preamble p;
  ASSERT_TRUE(recv_all(fd, &p, sizeof(p)));
  ASSERT_EQ(p.kind, same_host::kWelcome);
  std::string welcome(p.body, '\0');
  ASSERT_TRUE(recv_all(fd, welcome.data(), welcome.size()));
  Preamble frame;
  frame.kind = same_host::kFrame;
  frame.body = 16;
  frame.inline_bytes = ~uint64_t{0} - 4;  // with the body: 11 bytes, once wrapped
  send_all(fd, &frame, sizeof(frame));
  Preamble goodbye;
  ASSERT_TRUE(recv_all(fd, &goodbye, sizeof(goodbye)));
  ASSERT_EQ(goodbye.kind, same_host::kGoodbye);
  std::string why(goodbye.body, '\0');
  ASSERT_TRUE(recv_all(fd, why.data(), why.size()));
  EXPECT_NE(why.find("2^64"), std::string::npos) << why;
  EXPECT_EQ(why.find("a frame of 11 bytes"), std::string::npos) << why;
  ::close(fd);
}

// Reads a hello's welcome; true if the server admitted the connection.
bool welcomed(int fd) {
  Preamble p;
  if (!recv_all(fd, &p, sizeof(p)) || p.kind != same_host::kWelcome) return false;
  std::string body(p.body, '\0');
  if (!recv_all(fd, body.data(), body.size())) return false;
  same_host::WelcomeBody w;
  std::memcpy(&w, body.data(), sizeof(w));
  return w.code == 0;
}

// The next message: a goodbye's text, or "reply" for a frame.
std::string next_message(int fd) {
  Preamble p;
  if (!recv_all(fd, &p, sizeof(p))) return "closed";
  if (p.kind == same_host::kGoodbye) {
    std::string why(p.body, '\0');
    return recv_all(fd, why.data(), why.size()) ? why : "closed";
  }
  return p.kind == same_host::kFrame ? "reply" : "other";
}

// What the frames being read may hold is bounded per worker and in all: a
// frame claiming more than the rest of either budget ends its connection
// before it is allocated, while one within them is served.
TEST(SameHostTransportTest, FramesBeingReadStayWithinThePeerAndTotalBudgets) {
  ServerLimits limits;
  limits.max_message_bytes = 8 << 20;
  limits.max_buffered_bytes = 1 << 20;
  limits.max_buffered_bytes_per_peer = 768 << 10;
  Echo echo(Security{}, limits);
  const at::Tensor big = at::full({(900 << 10) / 4}, 1.0f);    // past the peer's budget
  const at::Tensor half = at::full({(600 << 10) / 4}, 2.0f);  // within it
  {
    int fd = raw_connect(echo.socket_name());
    hello(fd, 1);
    ASSERT_TRUE(welcomed(fd));
    const std::string req = raw_request(big, 1);
    send_all(fd, req.data(), req.size());
    const std::string why = next_message(fd);
    EXPECT_NE(why.find("budget"), std::string::npos) << why;
    ::close(fd);
  }
  // Worker 1 leaves a frame halfway; worker 0's frame would pass the total.
  int stalled = raw_connect(echo.socket_name());
  hello(stalled, 1);
  ASSERT_TRUE(welcomed(stalled));
  const std::string first = raw_request(half, 1);
  send_all(stalled, first.data(), first.size() / 2);
  absl::SleepFor(absl::Milliseconds(100));  // read as far as it goes
  int other = raw_connect(echo.socket_name());
  hello(other, 0);
  ASSERT_TRUE(welcomed(other));
  const std::string second = raw_request(half, 2);
  send_all(other, second.data(), second.size());
  const std::string why = next_message(other);
  EXPECT_NE(why.find("budget"), std::string::npos) << why;
  ::close(other);
  // The stalled frame, once whole, is served; so is a later one of worker 0.
  send_all(stalled, first.data() + first.size() / 2, first.size() - first.size() / 2);
  EXPECT_EQ(next_message(stalled), "reply");
  ::close(stalled);
  int later = raw_connect(echo.socket_name());
  hello(later, 0);
  ASSERT_TRUE(welcomed(later));
  send_all(later, second.data(), second.size());
  EXPECT_EQ(next_message(later), "reply");
  ::close(later);
}

// The same on the gRPC transport: a worker's newest stream replaces its
// oldest when its slots are full.
TEST(SameHostTransportTest, AWorkersNewestGrpcStreamReplacesItsOldest) {
  ServerLimits limits;
  limits.max_streams_per_worker = 1;
  Echo echo(Security{}, limits);
  PeerOptions options;
  options.self = 1;  // no same-host endpoint: over gRPC
  auto call = [&](Channel* ch, Replies* replies, uint64_t id) {
    if (!ch->send(request(at::arange(4, at::kFloat), id), SendOptions{})) return false;
    echo.transport()->drive([&] {
      absl::MutexLock lock(&replies->mu);
      return replies->frames.size() >= id || replies->ended;
    }, absl::Now() + absl::Seconds(20));
    return replies->wait_for(id);
  };
  Replies first;
  auto a = echo.transport()->connect(echo.address(), options, first.on_frame(), first.on_close());
  ASSERT_TRUE(call(a.get(), &first, 1));
  Replies second;
  auto b = echo.transport()->connect(echo.address(), options, second.on_frame(), second.on_close());
  EXPECT_TRUE(call(b.get(), &second, 1)) << "the newer stream was refused";
  // The older stream was ended by the server: its next call finds it so
  // (an idle gRPC stream learns of its end when it is used).
  EXPECT_FALSE(call(a.get(), &first, 2)) << "the older stream still serves";
  EXPECT_TRUE(a->broken());
  b->close(false);
  a->close(false);
}

// A refused hello learns nothing usable: not the address of the server's
// probe, not whether the server could read its memory, no worker ids or
// counts; an admitted one gets the probe.
TEST(SameHostTransportTest, ARefusalCarriesNothingUsable) {
  Security job;
  job.token = "the job's secret";
  Echo echo(job);
  auto welcome_of = [&](int worker, std::string* message) {
    int fd = raw_connect(echo.socket_name());
    Preamble p;
    p.kind = same_host::kHello;
    const std::string proof =
        rpc::internal::auth_proof(job.token, {"rpc", "same-host", worker, -1});
    p.body = sizeof(HelloBody) + proof.size();
    HelloBody h;
    h.worker = worker;
    h.proof_size = proof.size();
    h.probe = 16;  // any address: the server may try to read it
    send_all(fd, &p, sizeof(p));
    send_all(fd, &h, sizeof(h));
    send_all(fd, proof.data(), proof.size());
    same_host::WelcomeBody w;
    Preamble got;
    EXPECT_TRUE(recv_all(fd, &got, sizeof(got)));
    std::string body(got.body, '\0');
    EXPECT_TRUE(recv_all(fd, body.data(), body.size()));
    std::memcpy(&w, body.data(), sizeof(w));
    *message = body.substr(sizeof(w));
    ::close(fd);
    return w;
  };
  std::string message;
  for (int worker : {7, -3}) {  // no such worker (world size 2)
    const same_host::WelcomeBody refused = welcome_of(worker, &message);
    EXPECT_NE(refused.code, 0);
    EXPECT_EQ(refused.probe, 0u) << "a refusal gave the probe's address";
    EXPECT_EQ(refused.cross_memory, 0u);
    EXPECT_EQ(message.find_first_of("0123456789"), std::string::npos) << message;
  }
  const same_host::WelcomeBody admitted = welcome_of(1, &message);
  EXPECT_EQ(admitted.code, 0) << message;
  EXPECT_NE(admitted.probe, 0u);
}

// Channels to two servers that stop reading (each holds a request, and
// reads no more while one is pending) keep writes queued; closing both
// gracefully, each close begun first, waits about 5 s in all for those
// writes, not 5 s per channel.
TEST(SameHostTransportTest, GracefulClosesBegunTogetherWaitTogether) {
  absl::Notification release;
  Replies replies[2];  // outlives the channels
  ServerLimits limits;
  limits.world_size = 2;
  limits.max_pending_requests = 1;
  auto hold = [&](std::shared_ptr<Responder> r, Frame f) {
    release.WaitForNotificationWithTimeout(absl::Seconds(20));
    Echo::reply(r, std::move(f));
  };
  std::vector<std::shared_ptr<Transport>> transports;
  std::vector<std::unique_ptr<Server>> servers;
  std::vector<std::shared_ptr<Channel>> channels;
  // However the test ends: the handlers return, and the channels close.
  absl::Cleanup done = [&] {
    if (!release.HasBeenNotified()) release.Notify();
    for (auto& ch : channels) ch->close(/*graceful=*/false);
    for (auto& server : servers) server->shutdown(absl::ZeroDuration());
  };
  for (int i = 0; i < 2; ++i) {
    transports.push_back(make_same_host_transport(make_default_transport()));
    servers.push_back(transports[i]->listen(
        "127.0.0.1", limits, Security{}, [](int, const Frame&) { return absl::OkStatus(); }, hold,
        hold));
    PeerOptions options;
    options.self = 1;
    options.same_host_endpoint = servers[i]->same_host_endpoint();
    channels.push_back(transports[i]->connect(
        "127.0.0.1:" + std::to_string(servers[i]->port()), options, replies[i].on_frame(),
        replies[i].on_close()));
  }
  // Inline tensors (below the cross-memory size): about 5 MiB per
  // channel, far more than a socket holds.
  const at::Tensor t = at::arange(static_cast<int64_t>(kCrossMemoryMinBytes / 8 - 1), at::kDouble);
  for (int i = 0; i < 2; ++i) {
    for (uint64_t id = 1; id <= 160; ++id) ASSERT_TRUE(channels[i]->send(request(t, id), {}));
  }
  // Each server reads its first request and stops; the rest stays queued.
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time start = absl::Now();
  for (auto& ch : channels) ch->begin_close();
  EXPECT_FALSE(channels[0]->send(request(t, 161), {})) << "a frame after begin_close";
  for (auto& ch : channels) ch->close(/*graceful=*/true);
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Seconds(4)) << "the closes did not wait for the queued writes";
  EXPECT_LT(took, absl::Seconds(8)) << "the closes waited one after the other";
}

}  // namespace
}  // namespace ddprpc::rpc::transport
