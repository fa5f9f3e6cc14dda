// The bulk path between two workers of one process over loopback: large
// tensors lent both ways and pulled over several connections, and the
// hostile cases: strangers and wrong proofs on the bulk port, a frame
// naming a lend that does not exist, and a lender that dies or stalls
// mid-transfer (pulls of others' lends: internal/bulk_lender_test.cc). Each ends
// the connection or fails the call, and the worker goes on serving; a pull
// that stalls holds neither the server's reader nor the caller's.
#include "rpc/transport/bulk_transport.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "rpc/core/internal/auth.h"
#include "rpc/transport/internal/bulk_wire.h"

namespace ddprpc::rpc::transport {
namespace {

using internal::Frame;

constexpr char kToken[] = "bulk-test-token";

Security job() {
  Security s;
  s.token = kToken;
  return s;
}

Frame request(const std::vector<at::Tensor>& tensors, uint64_t id, int src) {
  Frame f;
  f.header.set_kind(wire::REQUEST);
  f.header.set_id(id);
  f.header.set_src(src);
  internal::encode_value(c10::IValue(tensors), f.header.mutable_payload(), &f);
  return f;
}

std::vector<at::Tensor> tensors_of(const Frame& f) {
  return internal::decode_value(f.header.payload(), f).toTensorVector();
}

struct Replies {
  absl::Mutex mu;
  std::vector<Frame> frames ABSL_GUARDED_BY(mu);
  Channel::OnFrame on_frame() {
    return [this](Frame f) {
      absl::MutexLock lock(&mu);
      frames.push_back(std::move(f));
      return absl::OkStatus();
    };
  }
  // The reply to the n-th request (1-based), waiting up to 20 s.
  Frame wait_for(size_t n) {
    absl::MutexLock lock(&mu);
    auto got = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return frames.size() >= n; };
    mu.AwaitWithTimeout(absl::Condition(&got), absl::Seconds(20));
    return frames.size() >= n ? frames[n - 1] : Frame{};
  }
};

// A worker with a bulk transport and a server that echoes every request
// back as its reply.
class Worker {
 public:
  Worker(int self, int world_size, const std::string& capture_dir = "",
         BulkOptions bulk = {}) : self_(self) {
    TransportOptions options;
    options.capture_frames_dir = capture_dir;
    transport_ = make_bulk_transport(make_default_transport(options), bulk);
    ServerLimits limits;
    limits.self = self;
    limits.world_size = world_size;
    auto echo = [this](std::shared_ptr<Responder> r, Frame f) {
      absl::Notification* hold;
      {
        absl::MutexLock lock(&mu_);
        ++served_;
        hold = hold_;
      }
      if (hold) hold->WaitForNotificationWithTimeout(absl::Seconds(20));
      f.header.set_kind(wire::RESPONSE);
      f.header.set_src(self_);
      r->send(std::move(f));
    };
    server_ = transport_->listen("127.0.0.1", limits, job(),
                                 [](int, const Frame&) { return absl::OkStatus(); }, echo, echo);
  }
  ~Worker() { server_->shutdown(absl::ZeroDuration()); }
  std::string address() const { return absl::StrCat("127.0.0.1:", server_->port()); }
  std::string bulk_endpoint() const { return server_->bulk_endpoint(); }
  Transport* transport() { return transport_.get(); }
  int served() {
    absl::MutexLock lock(&mu_);
    return served_;
  }
  // Requests from now on are answered once `hold` is notified.
  void hold_replies(absl::Notification* hold) {
    absl::MutexLock lock(&mu_);
    hold_ = hold;
  }
  std::shared_ptr<Channel> connect_to(const Worker& other, Replies* replies) {
    PeerOptions options;
    options.self = self_;
    options.peer = other.self_;
    options.security = job();
    return transport_->connect(other.address(), options, replies->on_frame(),
                               [](const CloseReason&) {});
  }

 private:
  const int self_;
  std::shared_ptr<Transport> transport_;
  std::unique_ptr<Server> server_;
  absl::Mutex mu_;
  int served_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Notification* hold_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// `from` sends `t` to `to` on a new channel and gets it back whole.
void echoes(Worker* from, const Worker& to, const at::Tensor& t) {
  Replies replies;
  auto ch = from->connect_to(to, &replies);
  ASSERT_TRUE(ch->send(request({t}, 1, 1), {}));
  Frame reply = replies.wait_for(1);
  ASSERT_EQ(reply.header.kind(), wire::RESPONSE) << reply.header.error();
  EXPECT_TRUE(at::equal(tensors_of(reply)[0], t));
  ch->close(false);
}

void world(std::vector<Worker*> workers, std::vector<std::string> endpoints = {}) {
  if (endpoints.empty()) {
    for (Worker* w : workers) endpoints.push_back(w->bulk_endpoint());
  }
  for (Worker* w : workers) {
    w->transport()->world_known(std::vector<std::string>(endpoints.size()), endpoints);
  }
}

// Paths of the files in `dir` (frames captured by a transport).
std::vector<std::string> captured_files(const std::string& dir) {
  std::vector<std::string> paths;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return paths;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') paths.push_back(dir + "/" + e->d_name);
  }
  closedir(d);
  return paths;
}

// Sizes of the files in `dir`.
std::vector<int64_t> captured_sizes(const std::string& dir) {
  std::vector<int64_t> sizes;
  for (const std::string& path : captured_files(dir)) {
    struct stat st;
    if (stat(path.c_str(), &st) == 0) sizes.push_back(st.st_size);
  }
  return sizes;
}

// A directory for captured frames, under the test's temporary directory,
// removed with its files when the test ends.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string templ = absl::StrCat(base != nullptr ? base : "/tmp", "/bulk_test_XXXXXX");
    path_ = mkdtemp(templ.data()) != nullptr ? templ : "";
  }
  ~TempDir() {
    if (path_.empty()) return;
    if (DIR* d = opendir(path_.c_str())) {
      while (dirent* e = readdir(d)) {
        if (e->d_name[0] != '.') unlink((path_ + "/" + e->d_name).c_str());
      }
      closedir(d);
    }
    rmdir(path_.c_str());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(BulkTransportTest, LargeTensorsAreLentBothWaysAndArriveWhole) {
  TempDir temp0, temp1;
  const std::string dir0 = temp0.path(), dir1 = temp1.path();
  ASSERT_FALSE(dir0.empty());
  ASSERT_FALSE(dir1.empty());
  Worker w0(0, 2, dir0), w1(1, 2, dir1);
  ASSERT_FALSE(w0.bulk_endpoint().empty());
  world({&w0, &w1});
  Replies replies;
  auto ch = w1.connect_to(w0, &replies);
  // 4 MiB (split over three connections), an odd size the ranges do not
  // divide, one just under the threshold (travels in the frame), a small one.
  at::Tensor big = at::arange(1 << 20, at::kInt);
  at::Tensor odd = at::arange((3 << 20) + 3, at::kByte);
  at::Tensor under = at::arange((256 << 10) / 4 - 1, at::kFloat);
  at::Tensor small = at::arange(5, at::kDouble);
  for (uint64_t id = 1; id <= 3; ++id) {
    ASSERT_TRUE(ch->send(request({big, odd, under, small}, id, 1), {}));
    Frame reply = replies.wait_for(id);
    ASSERT_EQ(reply.header.kind(), wire::RESPONSE) << reply.header.error();
    EXPECT_EQ(reply.header.id(), id);
    std::vector<at::Tensor> got = tensors_of(reply);
    ASSERT_EQ(got.size(), 4u);
    EXPECT_TRUE(at::equal(got[0], big));
    EXPECT_TRUE(at::equal(got[1], odd));
    EXPECT_TRUE(at::equal(got[2], under));
    EXPECT_TRUE(at::equal(got[3], small));
  }
  // What crossed on gRPC, both ways: the frames without the two lent tensors.
  const int64_t lent = big.nbytes() + odd.nbytes();
  for (const std::string& dir : {dir0, dir1}) {
    std::vector<int64_t> sizes = captured_sizes(dir);
    ASSERT_FALSE(sizes.empty()) << dir;
    for (int64_t size : sizes) {
      EXPECT_LT(size, lent / 4) << dir;
      EXPECT_GT(size, static_cast<int64_t>(under.nbytes())) << dir;  // it went inline
    }
  }
  ch->close(false);
}

TEST(BulkTransportTest, WithoutAPeerEndpointTensorsTravelInTheFrame) {
  TempDir temp0;
  const std::string dir0 = temp0.path();
  ASSERT_FALSE(dir0.empty());
  Worker w0(0, 2, dir0), w1(1, 2);
  world({&w0, &w1}, {w0.bulk_endpoint(), ""});  // worker 1 has no bulk path
  const at::Tensor big = at::arange(1 << 20, at::kInt);
  echoes(&w1, w0, big);
  for (int64_t size : captured_sizes(dir0)) EXPECT_GT(size, static_cast<int64_t>(big.nbytes()));
}

// Opens a raw connection to `endpoint` and sends `bytes`; true if the
// listener then closes it (reads 0) within 15 s.
bool closed_after(const std::string& endpoint, const std::string& bytes, std::string* answer) {
  std::string error;
  const int fd = bulk::connect_to(endpoint, absl::Seconds(5), &error);
  if (fd < 0) return false;
  (void)bulk::write_all(fd, bytes.data(), bytes.size(), absl::Seconds(5));
  char buf[64];
  bool closed = false;
  for (;;) {
    absl::Status got = bulk::read_exact(fd, buf, 1, absl::Seconds(15));
    if (!got.ok()) {
      closed = got.code() == absl::StatusCode::kUnavailable;
      break;
    }
    answer->push_back(buf[0]);
  }
  ::close(fd);
  return closed;
}

std::string hello(int from, int to, const std::string& proof) {
  std::string h(bulk::kHelloFixedBytes, '\0');
  std::memcpy(h.data(), bulk::kHelloMagic, 4);
  bulk::put_u32(h.data() + 4, from);
  bulk::put_u32(h.data() + 8, to);
  bulk::put_u32(h.data() + 12, proof.size());
  return h + proof;
}

TEST(BulkTransportTest, StrangersOnTheBulkPortAreClosedAndTheWorkerGoesOn) {
  Worker w0(0, 2), w1(1, 2);
  world({&w0, &w1});
  const std::string ep = w0.bulk_endpoint();
  const std::string right = rpc::internal::auth_proof(kToken, {"rpc", "bulk", 1, 0});
  struct Case {
    const char* what;
    std::string bytes;
  } cases[] = {
      {"garbage", std::string(64, 'x')},
      {"no proof", hello(1, 0, "")},
      {"another job's proof", hello(1, 0, rpc::internal::auth_proof("other", {"rpc", "bulk", 1, 0}))},
      {"a proof for the gRPC port", hello(1, 0, rpc::internal::auth_proof(kToken, {"rpc", "grpc", 1, 0}))},
      {"a proof naming another worker", hello(1, 0, rpc::internal::auth_proof(kToken, {"rpc", "bulk", 0, 0}))},
      {"a worker outside the world", hello(7, 0, right)},
      {"a hello to another worker", hello(1, 1, right)},
      {"a proof too large", hello(1, 0, std::string(4096, 'p'))},
  };
  for (const Case& c : cases) {
    std::string answer;
    EXPECT_TRUE(closed_after(ep, c.bytes, &answer)) << c.what;
    EXPECT_EQ(answer, "") << c.what;  // not even the ack
  }
  // A replayed proof: the first use is accepted, the second refused.
  std::string answer;
  const std::string proof = rpc::internal::auth_proof(kToken, {"rpc", "bulk", 1, 0});
  std::string error;
  const int fd = bulk::connect_to(ep, absl::Seconds(5), &error);
  ASSERT_GE(fd, 0) << error;
  const std::string h = hello(1, 0, proof);
  ASSERT_TRUE(bulk::write_all(fd, h.data(), h.size(), absl::Seconds(5)).ok());
  char ack[4];
  ASSERT_TRUE(bulk::read_exact(fd, ack, 4, absl::Seconds(5)).ok());
  EXPECT_EQ(std::string(ack, 4), "OK..");
  EXPECT_TRUE(closed_after(ep, h, &answer)) << "replayed proof";
  ::close(fd);

  echoes(&w1, w0, at::arange(1 << 20, at::kInt));
}

// A lender that answers the hello and a pull's head, sends half the bytes
// and then closes (it died), or sends nothing more (it stalled). It takes
// one connection, or with `many` each that comes (dying on each).
class BrokenLender {
 public:
  explicit BrokenLender(bool stall, bool many = false) {
    std::string error;
    fd_ = bulk::listen_on("127.0.0.1", &port_, &error);
    thread_ = std::thread([this, stall, many] {
      do {
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) return;
        serve(c, stall);
      } while (many);
    });
  }
  ~BrokenLender() {
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }
  std::string endpoint() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  static void serve(int c, bool stall) {
    char fixed[bulk::kHelloFixedBytes];
    if (bulk::read_exact(c, fixed, sizeof(fixed), absl::Seconds(5)).ok()) {
      std::string proof(bulk::get_u32(fixed + 12), '\0');
      char pull[bulk::kPullBytes];
      if (bulk::read_exact(c, proof.data(), proof.size(), absl::Seconds(5)).ok() &&
          bulk::write_all(c, bulk::kHelloAck, 4, absl::Seconds(5)).ok() &&
          bulk::read_exact(c, pull, sizeof(pull), absl::Seconds(5)).ok()) {
        const uint64_t length = bulk::get_u64(pull + 16);
        char head[bulk::kReplyHeadBytes] = {};
        bulk::put_u64(head + 8, length);
        std::vector<char> half(length / 2, 'h');
        (void)bulk::write_all(c, head, sizeof(head), absl::Seconds(5));
        (void)bulk::write_all(c, half.data(), half.size(), absl::Seconds(5));
        if (stall) {
          char any;
          (void)bulk::read_exact(c, &any, 1, absl::Seconds(20));  // until the puller leaves
        }
      }
    }
    ::close(c);
  }

  int fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

// A channel of worker 1 to `w0` on plain gRPC (no bulk path of its own),
// which takes replies with lent tensors as they come.
std::shared_ptr<Channel> plain_channel_of_worker1(const Worker& w0, Transport* plain,
                                                  Replies* replies) {
  PeerOptions options;
  options.self = 1;
  options.peer = 0;
  options.security = job();
  options.accept_lent_tensors = true;
  return plain->connect(w0.address(), options, replies->on_frame(), [](const CloseReason&) {});
}

// Sends `f` as worker 1 on a plain gRPC channel to `w0`; returns the reply.
Frame send_as_worker1(Worker* w0, Frame f) {
  Replies replies;
  auto plain = make_default_transport();
  auto ch = plain_channel_of_worker1(*w0, plain.get(), &replies);
  EXPECT_TRUE(ch->send(std::move(f), {}));
  Frame reply = replies.wait_for(1);
  ch->close(false);
  return reply;
}

// A request naming lend 4242 of 1 MiB, which worker 1 never made.
Frame send_lent_request(Worker* w0, uint64_t id) {
  Frame f = request({at::arange(1 << 18, at::kInt)}, id, 1);
  f.header.mutable_tensors(0)->set_lent(4242);
  return send_as_worker1(w0, std::move(f));
}

TEST(BulkTransportTest, LentTensorsPastMaxMessageBytesFailBeforeAnythingIsAllocated) {
  Worker w0(0, 2), w1(1, 2);
  world({&w0, &w1});
  // Four lent tensors of 2^62 bytes each: their sum wraps a 64-bit count.
  Frame f;
  f.header.set_kind(wire::REQUEST);
  f.header.set_id(8);
  f.header.set_src(1);
  f.header.mutable_payload()->set_none(true);
  for (int i = 0; i < 4; ++i) {
    auto* meta = f.header.add_tensors();
    meta->set_dtype(static_cast<int>(at::kByte));
    meta->add_sizes(int64_t{1} << 62);
    meta->set_nbytes(uint64_t{1} << 62);
    meta->set_lent(100 + i);
  }
  Frame reply = send_as_worker1(&w0, std::move(f));
  EXPECT_EQ(reply.header.kind(), wire::ERROR);
  EXPECT_NE(reply.header.error().find("max_message_bytes"), std::string::npos)
      << reply.header.error();
  EXPECT_EQ(w0.served(), 0);
  echoes(&w1, w0, at::arange(1 << 20, at::kInt));
}

TEST(BulkTransportTest, AFrameNamingAnUnknownLendFailsItsCallOnly) {
  Worker w0(0, 2), w1(1, 2);
  world({&w0, &w1});
  Frame reply = send_lent_request(&w0, 5);
  EXPECT_EQ(reply.header.kind(), wire::ERROR);
  EXPECT_EQ(reply.header.id(), 5u);
  EXPECT_NE(reply.header.error().find("worker 1"), std::string::npos) << reply.header.error();
  EXPECT_EQ(w0.served(), 0);  // the request never reached the server's handler
  Replies replies;
  auto ch = w1.connect_to(w0, &replies);
  ASSERT_TRUE(ch->send(request({at::arange(1 << 20, at::kInt)}, 1, 1), {}));
  EXPECT_EQ(replies.wait_for(1).header.kind(), wire::RESPONSE);
  ch->close(false);
}

TEST(BulkTransportTest, ALenderThatDiesOrStallsMidTransferFailsTheCallOnly) {
  for (bool stall : {false, true}) {
    SCOPED_TRACE(stall ? "stalls" : "dies");
    BulkOptions bulk;
    bulk.silence = absl::Seconds(1);
    bulk.streams = 1;  // the broken lender answers one connection
    Worker w0(0, 2, "", bulk), w1(1, 2);
    BrokenLender lender(stall);
    world({&w0, &w1}, {w0.bulk_endpoint(), lender.endpoint()});
    const absl::Time start = absl::Now();
    Frame reply = send_lent_request(&w0, 6);
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    EXPECT_EQ(reply.header.kind(), wire::ERROR);
    EXPECT_NE(reply.header.error().find("worker 1"), std::string::npos) << reply.header.error();
    EXPECT_EQ(w0.served(), 0);
    // Worker 0 goes on: a request without lent tensors is served.
    Replies replies;
    auto ch = w1.connect_to(w0, &replies);
    ASSERT_TRUE(ch->send(request({at::arange(8, at::kInt)}, 1, 1), {}));
    EXPECT_EQ(replies.wait_for(1).header.kind(), wire::RESPONSE);
    ch->close(false);
  }
}

// Worker 1 pulls worker 0's lent replies from `lender` instead of from
// worker 0; worker 0 pulls worker 1's lent requests from worker 1.
void replies_pulled_from(Worker* w0, Worker* w1, const BrokenLender& lender) {
  w0->transport()->world_known({"", ""}, {w0->bulk_endpoint(), w1->bulk_endpoint()});
  w1->transport()->world_known({"", ""}, {lender.endpoint(), w1->bulk_endpoint()});
}

// While a lender stalls a pull, the thread that read its frame goes on:
// the server answers other requests (the lent one came on the offload
// path, which has no watchdog), and the caller reads other replies.
TEST(BulkTransportTest, AStalledPullHoldsNoReader) {
  BulkOptions bulk;
  bulk.silence = absl::Seconds(4);
  bulk.streams = 1;  // the broken lender answers one connection
  {
    SCOPED_TRACE("server side");
    Worker w0(0, 2, "", bulk), w1(1, 2);
    BrokenLender lender(/*stall=*/true);
    world({&w0, &w1}, {w0.bulk_endpoint(), lender.endpoint()});
    Replies lent_replies, small_replies;
    auto plain = make_default_transport();
    auto lent_ch = plain_channel_of_worker1(w0, plain.get(), &lent_replies);
    auto small_ch = plain_channel_of_worker1(w0, plain.get(), &small_replies);
    Frame lent = request({at::arange(1 << 18, at::kInt)}, 11, 1);
    lent.header.mutable_tensors(0)->set_lent(4242);
    SendOptions offloaded;
    offloaded.more_in_flight = true;
    const absl::Time start = absl::Now();
    ASSERT_TRUE(lent_ch->send(std::move(lent), offloaded));
    absl::SleepFor(absl::Milliseconds(200));  // the pull has begun and stalls
    ASSERT_TRUE(small_ch->send(request({at::arange(8, at::kInt)}, 12, 1), offloaded));
    EXPECT_EQ(small_replies.wait_for(1).header.kind(), wire::RESPONSE);
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));  // long before the stall ends
    Frame failed = lent_replies.wait_for(1);
    EXPECT_EQ(failed.header.kind(), wire::ERROR);
    EXPECT_GE(absl::Now() - start, absl::Seconds(3));
    lent_ch->close(false);
    small_ch->close(false);
  }
  {
    SCOPED_TRACE("caller side");
    Worker w0(0, 2), w1(1, 2, "", bulk);
    BrokenLender lender(/*stall=*/true);
    replies_pulled_from(&w0, &w1, lender);
    Replies replies;
    auto ch = w1.connect_to(w0, &replies);
    const absl::Time start = absl::Now();
    ASSERT_TRUE(ch->send(request({at::arange(1 << 18, at::kInt)}, 21, 1), {}));
    absl::SleepFor(absl::Milliseconds(500));  // its reply came and its pull stalls
    ASSERT_TRUE(ch->send(request({at::arange(8, at::kInt)}, 22, 1), {}));
    Frame small = replies.wait_for(1);
    EXPECT_EQ(small.header.id(), 22u);
    EXPECT_EQ(small.header.kind(), wire::RESPONSE);
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
    Frame failed = replies.wait_for(2);
    EXPECT_EQ(failed.header.id(), 21u);
    EXPECT_EQ(failed.header.kind(), wire::ERROR);
    EXPECT_NE(failed.header.error().find("worker 0"), std::string::npos) << failed.header.error();
    ch->close(false);
  }
}

// A channel closed while its reply is being pulled: close() returns at
// once, the reply is never delivered, and the transport goes down cleanly.
TEST(BulkTransportTest, ClosingAChannelDropsTheRepliesBeingPulled) {
  BulkOptions bulk;
  bulk.silence = absl::Seconds(3);
  bulk.streams = 1;
  Worker w0(0, 2), w1(1, 2, "", bulk);
  BrokenLender lender(/*stall=*/true);
  replies_pulled_from(&w0, &w1, lender);
  Replies replies;
  auto ch = w1.connect_to(w0, &replies);
  ASSERT_TRUE(ch->send(request({at::arange(1 << 18, at::kInt)}, 31, 1), {}));
  absl::SleepFor(absl::Milliseconds(500));
  const absl::Time start = absl::Now();
  ch->close(false);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  absl::SleepFor(absl::Seconds(4));  // the stalled pull has failed by now
  absl::MutexLock lock(&replies.mu);
  EXPECT_TRUE(replies.frames.empty());
}

// ---------------------------------------------------------------- pushes

// Bulk options with pushes made whatever the CPUs (the rule that needs
// four is for speed, not for correctness).
BulkOptions pushing() {
  BulkOptions bulk;
  bulk.push_min_cpus = 0;
  return bulk;
}

// The frames captured in `dir`, parsed (lent tensors without their bytes).
std::vector<Frame> captured_frames(const std::string& dir) {
  std::vector<Frame> frames;
  for (const std::string& path : captured_files(dir)) {
    std::string bytes;
    if (FILE* f = std::fopen(path.c_str(), "rb")) {
      char buf[1 << 16];
      size_t n;
      while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) bytes.append(buf, n);
      std::fclose(f);
    }
    Frame frame;
    internal::ParseOptions options;
    options.accept_lent = true;
    if (internal::parse_frame(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                              &frame, options)
            .ok()) {
      frames.push_back(std::move(frame));
    }
  }
  return frames;
}

// Frames in `frames` whose first tensor was pushed.
int pushed_frames(const std::vector<Frame>& frames) {
  int n = 0;
  for (const Frame& f : frames) n += f.header.tensors_size() > 0 && f.header.tensors(0).pushed() > 0;
  return n;
}

// A channel closed with a request outstanding (its peer silent, say)
// releases that request's lends at once, not at the call's deadline: the
// next request to the same peer is lent again within the per-peer bound.
TEST(BulkTransportTest, AClosedChannelReleasesItsRequestsLends) {
  TempDir temp0;
  BulkOptions stalls;
  stalls.silence = absl::Seconds(3);
  stalls.streams = 1;
  BulkOptions small_bound;
  small_bound.max_lent_bytes_per_peer = 6 << 20;
  Worker w0(0, 2, temp0.path(), stalls), w1(1, 2, "", small_bound);
  // Worker 0 pulls worker 1's tensors from a lender that stalls: it
  // answers none of these requests in time.
  BrokenLender lender(/*stall=*/true, /*many=*/true);
  world({&w0}, {w0.bulk_endpoint(), lender.endpoint()});
  world({&w1}, {w0.bulk_endpoint(), w1.bulk_endpoint()});
  const at::Tensor big = at::arange(1 << 20, at::kInt);  // 4 MiB
  SendOptions far;
  far.deadline = absl::Now() + absl::Hours(1);
  Replies first_replies, second_replies;
  // Each channel closes once worker 0 has read its request (a close
  // before would cancel it unsent).
  auto await_captured = [&temp0](size_t n) {
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (captured_frames(temp0.path()).size() < n && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(20));
    }
  };
  auto first = w1.connect_to(w0, &first_replies);
  ASSERT_TRUE(first->send(request({big}, 1, 1), far));
  await_captured(1);
  first->close(false);
  auto second = w1.connect_to(w0, &second_replies);
  ASSERT_TRUE(second->send(request({big}, 2, 1), far));
  await_captured(2);
  second->close(false);
  const std::vector<Frame> frames = captured_frames(temp0.path());
  ASSERT_EQ(frames.size(), 2u);
  for (const Frame& f : frames) {
    ASSERT_EQ(f.header.tensors_size(), 1);
    EXPECT_NE(f.header.tensors(0).lent(), 0u)
        << "request " << f.header.id() << " travelled in its frame: the bound was still held";
  }
}

// Both ways, pushed tensors arrive whole, and each lend ends once its
// receiver has the bytes: 24 round trips of 4 MiB lend 96 MiB each way,
// past the 64 MiB a worker holds lent to one peer for replies, so a lend
// left behind would send a later reply's tensor in its frame.
TEST(BulkTransportTest, PushedTensorsArriveWholeAndTheirLendsEnd) {
  TempDir temp0, temp1;
  Worker w0(0, 2, temp0.path(), pushing()), w1(1, 2, temp1.path(), pushing());
  world({&w0, &w1});
  Replies replies;
  auto ch = w1.connect_to(w0, &replies);
  constexpr int kRounds = 24;
  for (uint64_t id = 1; id <= kRounds; ++id) {
    const at::Tensor big = at::arange(1 << 20, at::kInt).add_(static_cast<int64_t>(id));
    const at::Tensor odd = at::arange((1 << 20) + 3, at::kByte);
    ASSERT_TRUE(ch->send(request({big, odd}, id, 1), {}));
    Frame reply = replies.wait_for(id);
    ASSERT_EQ(reply.header.kind(), wire::RESPONSE) << reply.header.error();
    std::vector<at::Tensor> got = tensors_of(reply);
    ASSERT_EQ(got.size(), 2u);
    EXPECT_TRUE(at::equal(got[0], big)) << "round " << id;
    EXPECT_TRUE(at::equal(got[1], odd)) << "round " << id;
  }
  ch->close(false);
  for (const std::string& dir : {temp0.path(), temp1.path()}) {
    const std::vector<Frame> frames = captured_frames(dir);
    ASSERT_EQ(frames.size(), static_cast<size_t>(kRounds)) << dir;
    for (int64_t size : captured_sizes(dir)) EXPECT_LT(size, 64 << 10) << dir;
    // The first lends open the push connections; once open, pushes go.
    EXPECT_GE(pushed_frames(frames), kRounds / 2) << dir;
  }
}

// A receiver that takes no pushes refuses the push connections; the lender
// then lends for pulls, and its tensors arrive whole.
TEST(BulkTransportTest, TensorsForAReceiverThatTakesNoPushesArePulled) {
  TempDir temp0;
  BulkOptions no_push;
  no_push.push = false;
  Worker w0(0, 2, temp0.path(), no_push), w1(1, 2, "", pushing());
  world({&w0, &w1});
  Replies replies;
  auto ch = w1.connect_to(w0, &replies);
  const at::Tensor big = at::arange(1 << 20, at::kInt);
  for (uint64_t id = 1; id <= 6; ++id) {
    ASSERT_TRUE(ch->send(request({big}, id, 1), {}));
    Frame reply = replies.wait_for(id);
    ASSERT_EQ(reply.header.kind(), wire::RESPONSE) << reply.header.error();
    EXPECT_TRUE(at::equal(tensors_of(reply)[0], big));
    absl::SleepFor(absl::Milliseconds(50));  // time for a push connection to be tried
  }
  ch->close(false);
  const std::vector<Frame> frames = captured_frames(temp0.path());
  EXPECT_EQ(frames.size(), 6u);
  EXPECT_EQ(pushed_frames(frames), 0);
}

// A request from worker 1 whose 1 MiB tensor, lend 4242, it says it pushes
// over `ranges` connections.
Frame pushed_request(uint64_t id, uint32_t ranges) {
  Frame f = request({at::arange(1 << 18, at::kInt)}, id, 1);
  f.header.mutable_tensors(0)->set_lent(4242);
  f.header.mutable_tensors(0)->set_pushed(ranges);
  return f;
}

// A frame that says its tensor is pushed, whose bytes never come, is
// pulled once push_start_wait has passed: from a lender that dies here,
// which fails that call only.
TEST(BulkTransportTest, APushedTensorWhoseBytesNeverComeIsPulled) {
  BulkOptions bulk = pushing();
  bulk.silence = absl::Seconds(1);
  bulk.streams = 1;  // the broken lender answers one connection
  bulk.push_start_wait = absl::Milliseconds(300);
  Worker w0(0, 2, "", bulk), w1(1, 2);
  BrokenLender lender(/*stall=*/false);
  world({&w0, &w1}, {w0.bulk_endpoint(), lender.endpoint()});
  const absl::Time start = absl::Now();
  Frame reply = send_as_worker1(&w0, pushed_request(9, 2));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(reply.header.kind(), wire::ERROR);
  EXPECT_NE(reply.header.error().find("pulling lent tensor 4242"), std::string::npos)
      << reply.header.error();
  EXPECT_EQ(w0.served(), 0);
  echoes(&w1, w0, at::arange(8, at::kInt));  // worker 0 goes on
}

std::string push_hello(int from, int to, const std::string& proof) {
  std::string h = hello(from, to, proof);
  std::memcpy(h.data(), bulk::kPushHelloMagic, 4);
  return h;
}

std::string push_head(uint64_t id, uint64_t total, uint32_t index, uint32_t ranges) {
  std::string h(bulk::kPushHeadBytes, '\0');
  bulk::put_u64(h.data(), id);
  bulk::put_u64(h.data() + 8, total);
  bulk::put_u32(h.data() + 16, index);
  bulk::put_u32(h.data() + 20, ranges);
  return h;
}

// Strangers on the push path are closed before anything is read; a proven
// worker's push that no frame of its own claims, or that does not match
// its claim, ends its connection at once and sends that frame to a pull
// (which fails here, the lender being gone); the worker goes on.
TEST(BulkTransportTest, StrangersAndMalformedPushesEndTheirConnectionOnly) {
  BulkOptions bulk = pushing();
  bulk.silence = absl::Seconds(1);
  bulk.streams = 1;
  bulk.push_start_wait = absl::Seconds(20);  // only a failed claim ends the wait early
  Worker w0(0, 2, "", bulk), w1(1, 2);
  BrokenLender lender(/*stall=*/false, /*many=*/true);
  world({&w0, &w1}, {w0.bulk_endpoint(), lender.endpoint()});
  const std::string ep = w0.bulk_endpoint();
  const std::string right = rpc::internal::auth_proof(kToken, {"rpc", "bulk-push", 1, 0});
  struct Case {
    const char* what;
    std::string bytes;
  } strangers[] = {
      {"no proof", push_hello(1, 0, "")},
      {"a proof for pulls", push_hello(1, 0, rpc::internal::auth_proof(kToken, {"rpc", "bulk", 1, 0}))},
      {"another job's proof", push_hello(1, 0, rpc::internal::auth_proof("other", {"rpc", "bulk-push", 1, 0}))},
      {"a hello to another worker", push_hello(1, 1, right)},
  };
  for (const Case& c : strangers) {
    std::string answer;
    EXPECT_TRUE(closed_after(ep, c.bytes + push_head(1, 1 << 20, 0, 1), &answer)) << c.what;
    EXPECT_EQ(answer, "") << c.what;
  }
  // Proven, but pushing a tensor no frame names: closed once the claim
  // wait (the silence limit) has passed.
  {
    std::string answer;
    const std::string proof = rpc::internal::auth_proof(kToken, {"rpc", "bulk-push", 1, 0});
    EXPECT_TRUE(closed_after(ep, push_hello(1, 0, proof) + push_head(77, 1 << 20, 0, 1), &answer));
    EXPECT_EQ(answer, "OK..");
  }
  // A frame whose push does not match it: the wrong size, a range past the
  // last, the same range twice.
  struct Bad {
    const char* what;
    std::string heads;
  } bad[] = {
      {"another size", push_head(4242, 1 << 19, 0, 2)},
      {"a range past the last", push_head(4242, 1 << 20, 2, 2)},
      {"other ranges", push_head(4242, 1 << 20, 0, 3)},
  };
  uint64_t id = 40;
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    Replies replies;
    auto plain = make_default_transport();
    auto ch = plain_channel_of_worker1(w0, plain.get(), &replies);
    const absl::Time start = absl::Now();
    ASSERT_TRUE(ch->send(pushed_request(++id, 2), {}));
    std::string answer;
    const std::string proof = rpc::internal::auth_proof(kToken, {"rpc", "bulk-push", 1, 0});
    EXPECT_TRUE(closed_after(ep, push_hello(1, 0, proof) + b.heads, &answer));
    Frame reply = replies.wait_for(1);
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // not the 20 s start wait
    EXPECT_EQ(reply.header.kind(), wire::ERROR);
    EXPECT_NE(reply.header.error().find("pulling lent tensor 4242"), std::string::npos)
        << reply.header.error();
    ch->close(false);
  }
  EXPECT_EQ(w0.served(), 0);
  echoes(&w1, w0, at::arange(8, at::kInt));  // worker 0 goes on
}

// Closing channels to several peers that do not end their streams (each
// holds a request unanswered) waits about 5 s in all when each channel's
// close was begun first, not 5 s per channel.
TEST(BulkTransportTest, GracefulClosesBegunTogetherWaitTogether) {
  absl::Notification release;
  Worker w0(0, 3), w2(2, 3), w1(1, 3);
  absl::Cleanup unblock = [&] {  // however the test ends, before the workers go
    if (!release.HasBeenNotified()) release.Notify();
  };
  w0.hold_replies(&release);
  w2.hold_replies(&release);
  Replies r0, r2;
  auto c0 = w1.connect_to(w0, &r0);
  auto c2 = w1.connect_to(w2, &r2);
  ASSERT_TRUE(c0->send(request({at::arange(4)}, 1, 1), {}));
  ASSERT_TRUE(c2->send(request({at::arange(4)}, 1, 1), {}));
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((w0.served() < 1 || w2.served() < 1) && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(w0.served() + w2.served(), 2);
  const absl::Time start = absl::Now();
  c0->begin_close();
  c2->begin_close();
  EXPECT_FALSE(c0->send(request({at::arange(4)}, 2, 1), {})) << "a frame after begin_close";
  c0->close(/*graceful=*/true);
  c2->close(/*graceful=*/true);
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Seconds(4)) << "the closes did not wait for the peers";
  EXPECT_LT(took, absl::Seconds(8)) << "the closes waited one after the other";
}

}  // namespace
}  // namespace ddprpc::rpc::transport
