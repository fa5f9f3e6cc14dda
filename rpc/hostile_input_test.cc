// Hostile peers against live workers over real connections: every class of
// malformed or abusive input ends only the offending stream or call, and
// the worker goes on serving the job's own calls. (A worker that crashed
// would fail its rank, and so the test.)
#include <ATen/TensorOperators.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

#include <arpa/inet.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <malloc.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "rpc/core/internal/fault.h"
#include "rpc/profiler/profiler.h"
#include "rpc/rendezvous/store.h"
#include "rpc/rpc.h"
#include "rpc/rref/rref.h"
#include "rpc/testing/raw_peer.h"
#include "tests/multiprocess.h"

namespace rpc = ddprpc::rpc;
namespace mp = ddprpc::testing;
namespace wire = ddprpc::wire;
using rpc::testing::RawStream;

namespace {

at::Tensor add(at::Tensor a, at::Tensor b) { return a + b; }
DDPRPC_REGISTER_FUNCTION(add);

int64_t sleep_ms(int64_t ms) {
  absl::SleepFor(absl::Milliseconds(ms));
  return ms;
}
DDPRPC_REGISTER_FUNCTION(sleep_ms);

int64_t resident_mib() { return rpc::testing::resident_bytes() >> 20; }
DDPRPC_REGISTER_FUNCTION(resident_mib);

// Bytes the process has allocated and not freed (glibc's count): unlike
// resident memory, blocks freed into the allocator's arenas do not count.
int64_t allocated_bytes() {
  const struct mallinfo2 m = ::mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
}

// Samples the worker's allocated and resident memory every 5 ms, on a thread
// of its own (a sampling call could wait behind the requests it measures),
// from start_sampling until stop_sampling, which returns the most seen of
// each, in MiB, as "allocated resident".
struct Sampler {
  std::atomic<bool> stop{false};
  int64_t most_allocated = 0, most_resident = 0;  // written by `thread` only
  std::thread thread;
};
Sampler* sampler = nullptr;

int64_t start_sampling() {
  sampler = new Sampler();
  sampler->most_allocated = allocated_bytes();
  sampler->most_resident = rpc::testing::resident_bytes();
  sampler->thread = std::thread([s = sampler] {
    while (!s->stop) {
      absl::SleepFor(absl::Milliseconds(5));
      s->most_allocated = std::max(s->most_allocated, allocated_bytes());
      s->most_resident = std::max(s->most_resident, rpc::testing::resident_bytes());
    }
  });
  return 0;
}
DDPRPC_REGISTER_FUNCTION(start_sampling);

std::string stop_sampling() {
  sampler->stop = true;
  sampler->thread.join();
  std::string most = absl::StrCat(sampler->most_allocated >> 20, " ", sampler->most_resident >> 20);
  delete sampler;
  sampler = nullptr;
  return most;
}
DDPRPC_REGISTER_FUNCTION(stop_sampling);

std::string memory_mib() {
  return absl::StrCat(allocated_bytes() >> 20, " ", rpc::testing::resident_bytes() >> 20);
}
DDPRPC_REGISTER_FUNCTION(memory_mib);

// A reply of `bytes` bytes.
at::Tensor payload(int64_t bytes) { return at::zeros({bytes}, at::kByte); }
DDPRPC_REGISTER_FUNCTION(payload);

int64_t count_args(std::vector<at::Tensor> tensors) { return static_cast<int64_t>(tensors.size()); }
DDPRPC_REGISTER_FUNCTION(count_args);

int64_t string_size(std::string s) { return static_cast<int64_t>(s.size()); }
DDPRPC_REGISTER_FUNCTION(string_size);

// Holds its argument for `ms`, then gives its size.
int64_t hold_string(std::string s, int64_t ms) {
  absl::SleepFor(absl::Milliseconds(ms));
  return static_cast<int64_t>(s.size());
}
DDPRPC_REGISTER_FUNCTION(hold_string);

// Completes from a thread outside any request (its reply goes out through
// the agent's reply sender).
rpc::Future<int64_t> later(int64_t ms) {
  rpc::Future<int64_t> f;
  std::thread([f, ms] {
    absl::SleepFor(absl::Milliseconds(ms));
    f.set_result(ms);
  }).detach();
  return f;
}
DDPRPC_REGISTER_FUNCTION(later);

int64_t arm_fault(std::string point, int64_t skip) {
  rpc::internal::arm_fault(point, 1, static_cast<int>(skip));
  return 0;
}
DDPRPC_REGISTER_FUNCTION(arm_fault);

int64_t fault_count(std::string point) { return rpc::internal::fault_count(point); }
DDPRPC_REGISTER_FUNCTION(fault_count);

// A registered class, and a function using an RRef of it on its owner.
struct Box {
  explicit Box(int64_t n) : n(n) {}
  int64_t size() { return n; }
  int64_t n;
};
static auto box_registration =
    rpc::register_class<Box>("Box").constructor<int64_t>().method("size", &Box::size);
int64_t box_size(rpc::RRef<Box> box) { return box.local_value()->n; }
DDPRPC_REGISTER_FUNCTION(box_size);

int64_t owned_rrefs() { return std::stoll(rpc::get_debug_info()["rref.owned"]); }
DDPRPC_REGISTER_FUNCTION(owned_rrefs);

std::string address_of(const std::string& worker) { return rpc::get_worker_info(worker).address; }
// The worker these tests attack.
int victim_id() { return rpc::get_worker_info("worker1").id; }

// The job's own calls still work.
void expect_serves(const std::string& worker) {
  at::Tensor t = at::ones({2});
  EXPECT_TRUE(at::equal(rpc::rpc_sync<at::Tensor>(worker, "add", t, t), t + t));
}

// A stream that sends `bytes` (as worker `as`, or naming `as_text`) ends
// with `code`, and its status mentions `needle`.
void expect_stream_ended(const std::string& address, std::optional<int> as,
                         const std::string& bytes, grpc::StatusCode code,
                         const std::string& needle, const std::string& as_text = "") {
  RawStream stream(address, victim_id(), as, absl::Seconds(20), as_text);
  stream.write_bytes(bytes);
  grpc::Status status = stream.finish();
  EXPECT_EQ(status.error_code(), code) << needle << ": " << status.error_message();
  EXPECT_NE(status.error_message().find(needle), std::string::npos)
      << "'" << needle << "' missing from: " << status.error_message();
}

wire::Header add_request(int src) {
  at::Tensor t = at::ones({2});
  return rpc::testing::request_frame(src, 1, "add", {c10::IValue(t), c10::IValue(t)}).header;
}

MULTIPROCESS_TEST(HostileInputTest, MalformedFramesEndOnlyTheirStream, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    const std::string victim = address_of("worker1");
    const std::string body(16, '\0');  // the bytes of the two 2-float tensors

    // A well-formed request on a raw stream is answered.
    {
      RawStream stream(victim, victim_id(), 0);
      ASSERT_TRUE(stream.write_frame(add_request(0), body));
      auto reply = stream.read();
      ASSERT_TRUE(reply.has_value());
      EXPECT_EQ(reply->header.kind(), wire::RESPONSE);
    }
    // Dtypes: undefined (18, the crash of old), quantized, out of range.
    for (int32_t dtype : {18, 12, 99, -5}) {
      wire::Header h = add_request(0);
      h.mutable_tensors(0)->set_dtype(dtype);
      expect_stream_ended(victim, 0, rpc::testing::raw_frame(h, body),
                          grpc::StatusCode::INVALID_ARGUMENT, "dtype");
      expect_serves("worker1");
    }
    // Shapes whose element count times item size wraps 64 bits.
    {
      wire::Header h = add_request(0);
      auto* meta = h.mutable_tensors(0);
      meta->clear_sizes();
      meta->add_sizes(int64_t{1} << 32);
      meta->add_sizes(int64_t{1} << 32);
      meta->add_sizes(4);
      meta->set_nbytes(0);
      expect_stream_ended(victim, 0, rpc::testing::raw_frame(h, std::string(8, '\0')),
                          grpc::StatusCode::INVALID_ARGUMENT, "too many elements");
    }
    // A header size prefix far beyond the frame; plain garbage.
    expect_stream_ended(victim, 0, std::string("\xff\xff\xff\xff", 4) + "abc",
                        grpc::StatusCode::INVALID_ARGUMENT, "exceeds the frame");
    expect_stream_ended(victim, 0, std::string("\x10\x00\x00\x00not a frame at all", 22),
                        grpc::StatusCode::INVALID_ARGUMENT, "malformed frame");
    // Kinds a caller never sends.
    for (wire::Kind kind : {wire::RESPONSE, wire::ERROR, wire::KIND_UNSPECIFIED}) {
      wire::Header h = add_request(0);
      h.set_kind(kind);
      expect_stream_ended(victim, 0, rpc::testing::raw_frame(h, body),
                          grpc::StatusCode::INVALID_ARGUMENT, "kind");
    }
    // Identity: a frame from another worker than its stream's; streams
    // naming no worker or one outside the job.
    expect_stream_ended(victim, 0, rpc::testing::raw_frame(add_request(1), body),
                        grpc::StatusCode::PERMISSION_DENIED, "claims to come from worker 1");
    expect_stream_ended(victim, std::nullopt, rpc::testing::raw_frame(add_request(0), body),
                        grpc::StatusCode::PERMISSION_DENIED, "ddprpc-worker");
    for (const char* bad : {"7", "-1", "zero"}) {
      expect_stream_ended(victim, std::nullopt, rpc::testing::raw_frame(add_request(0), body),
                          grpc::StatusCode::PERMISSION_DENIED, "ddprpc-worker", bad);
    }
    expect_serves("worker1");
  }
  rpc::shutdown();
}

// 200,000 zero-size tensor entries in 1.4 MB kept a worker busy for minutes
// once; now the frame is refused at once, and the most a frame may carry
// costs little.
MULTIPROCESS_TEST(HostileInputTest, ManyTensorEntriesAreBoundedAndCheap, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    const std::string victim = address_of("worker1");
    auto many = [](int n) {
      wire::Header h;
      h.set_kind(wire::REQUEST);
      h.set_id(1);
      h.set_src(0);
      h.set_function("count_args");
      auto* list = h.mutable_payload()->mutable_tuple()->add_items()->mutable_tensor_list();
      for (int i = 0; i < n; ++i) {
        list->add_items()->set_tensor(i);
        auto* meta = h.add_tensors();
        meta->set_dtype(6);
        meta->add_sizes(0);
      }
      return h;
    };
    absl::Time start = absl::Now();
    expect_stream_ended(victim, 0, rpc::testing::raw_frame(many(200000)),
                        grpc::StatusCode::INVALID_ARGUMENT, "tensors");
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
    start = absl::Now();
    RawStream stream(victim, victim_id(), 0);
    ASSERT_TRUE(stream.write_frame(many(rpc::internal::kMaxTensorsPerFrame)));
    auto reply = stream.read();
    ASSERT_TRUE(reply.has_value());
    ASSERT_EQ(reply->header.kind(), wire::RESPONSE) << reply->header.error();
    EXPECT_EQ(reply->header.payload().i(), rpc::internal::kMaxTensorsPerFrame);
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    expect_serves("worker1");
  }
  rpc::shutdown();
}

// A frame over max_message_bytes is refused by the receiver, which does
// not keep it; one far larger than what the worker buffers at most is cut
// off before it has all arrived.
MULTIPROCESS_TEST(HostileInputTest, OversizedMessagesAreRefusedByTheReceiver, 2) {
  rpc::RpcBackendOptions options = mp::backend_options();
  options.max_message_bytes = 1 << 20;
  options.max_receive_buffer_bytes = 64 << 20;
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, options);
  if (mp::rank() == 0) {
    const std::string victim = address_of("worker1");
    const int64_t before = rpc::rpc_sync<int64_t>("worker1", "resident_mib");
    auto oversized = [](int64_t bytes) {
      wire::Header h;
      h.set_kind(wire::REQUEST);
      h.set_src(0);
      h.set_function("count_args");
      auto* meta = h.add_tensors();
      meta->set_dtype(0);
      meta->add_sizes(bytes);
      meta->set_nbytes(bytes);
      h.mutable_payload()->mutable_tuple()->add_items()->mutable_tensor_list()->add_items()->set_tensor(0);
      return rpc::testing::raw_frame(h, std::string(bytes, 'x'));
    };
    for (int i = 0; i < 4; ++i) {
      RawStream stream(victim, victim_id(), 0);
      stream.write_bytes(oversized(16 << 20));
      grpc::Status status = stream.finish();
      EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
      EXPECT_NE(status.error_message().find("max_message_bytes"), std::string::npos)
          << status.error_message();
    }
    {
      RawStream stream(victim, victim_id(), 0, absl::Seconds(60));
      stream.write_bytes(oversized(int64_t{1} << 30));
      grpc::Status status = stream.finish();
      EXPECT_FALSE(status.ok());
      std::printf("a 1 GiB message to a worker buffering 64 MiB ended: %s\n",
                  status.error_message().c_str());
    }
    // gRPC's quota cancels streams at random once it is exhausted: a call
    // of ours on a connection it cut may fail once; the next reconnects.
    int64_t after = -1;
    try {
      after = rpc::rpc_sync<int64_t>("worker1", "resident_mib");
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kUnavailable) << e.what();
      after = rpc::rpc_sync<int64_t>("worker1", "resident_mib");
    }
    std::printf("resident memory of the receiver: %ld MiB before, %ld MiB after\n",
                static_cast<long>(before), static_cast<long>(after));
    EXPECT_LT(after - before, 160) << "MiB resident before " << before << ", after " << after;
    expect_serves("worker1");
  }
  rpc::shutdown();
}

// Large string arguments leave at most two of their copies behind in the
// callee, freed blocks that its allocator keeps for a while (how many varies
// from run to run: 0 to 2 were seen), never one per call: eight calls with
// 64 MiB each grow its resident memory by less than 2.5 such arguments. The
// transport used to grow a frame's head by doubling, which left a trail of
// 1..32 MiB blocks on top: about three arguments' worth (185 MiB). Over
// gRPC (mp::network_paths_only()), gRPC's own buffers hold more, so the
// bound is checked on the same-host transport only, and not under ASan; the
// figures are printed.
MULTIPROCESS_TEST(HostileInputTest, LargeStringArgumentsLeaveNoCopyBehind, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    const std::string big(64 << 20, 's');
    const int64_t before = rpc::rpc_sync<int64_t>("worker1", "resident_mib");
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "string_size", big), int64_t{64} << 20);
    }
    const int64_t after = rpc::rpc_sync<int64_t>("worker1", "resident_mib");
    std::printf("callee's resident memory around eight 64 MiB string calls: %ld MiB, then %ld MiB\n",
                static_cast<long>(before), static_cast<long>(after));
    // ASan's allocator keeps freed blocks in its quarantine (up to 256 MiB)
    // before reusing them: the bound is glibc's allocator's.
#if !defined(__SANITIZE_ADDRESS__)
    if (!mp::network_paths_only()) {
      EXPECT_LT(after - before, 160) << "MiB resident before " << before << ", after " << after;
    }
#endif
  }
  rpc::shutdown();
}

// A caller that sends requests and never reads the replies gets its
// stream paused at max_pending_reply_bytes; one whose requests pile up
// waiting for threads is refused past max_queued_requests. The victim's
// memory stays bounded and other workers are served meanwhile.
MULTIPROCESS_TEST(HostileInputTest, UnreadRepliesAndQueuedRequestsAreBounded, 3) {
  rpc::RpcBackendOptions options = mp::backend_options();
  options.num_worker_threads = 2;
  options.max_pending_requests_per_stream = 64;
  options.max_pending_reply_bytes = 4 << 20;
  options.max_queued_requests = 16;
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, options);
  if (mp::rank() == 0) {
    const std::string victim = address_of("worker1");
    const int64_t before = rpc::rpc_sync<int64_t>("worker1", "resident_mib");
    {
      // 2,000 requests for 1 MiB replies (2 GiB if all were kept), never read.
      std::optional<RawStream> flood;
      flood.emplace(victim, victim_id(), 0, absl::Seconds(60));
      std::atomic<bool> done{false};
      std::thread writer([&] {
        for (int i = 0; i < 2000 && !done; ++i) {
          auto frame = rpc::testing::request_frame(0, i + 1, "payload", {c10::IValue(int64_t{1} << 20)});
          if (!flood->write_bytes(rpc::testing::frame_bytes(frame))) break;
        }
      });
      absl::SleepFor(absl::Seconds(2));
      // Worker 2 is served while worker 1 holds the flood.
      auto served = rpc::rpc_async<at::Tensor>("worker2", "add", at::ones({1}), at::ones({1}));
      const int64_t during = rpc::rpc_sync<int64_t>("worker1", "resident_mib");
      std::printf("resident memory of the flooded worker: %ld MiB before, %ld MiB during\n",
                  static_cast<long>(before), static_cast<long>(during));
      EXPECT_LT(during - before, 160) << "MiB resident before " << before << ", during " << during;
      EXPECT_TRUE(served.wait_for(absl::Seconds(10)));
      done = true;
      // Cancelling the stream ends the writer's blocked write.
      flood.reset();
      writer.join();
    }
    // Requests that all wait for one of two threads: the queue holds 16.
    {
      RawStream flood(victim, victim_id(), 0, absl::Seconds(60));
      for (int i = 0; i < 60; ++i) {
        auto frame = rpc::testing::request_frame(0, i + 1, "sleep_ms", {c10::IValue(int64_t{200})});
        frame.header.set_more_in_flight(true);  // offloaded to the pool
        ASSERT_TRUE(flood.write_bytes(rpc::testing::frame_bytes(frame)));
      }
      int refused = 0, answered = 0;
      for (int i = 0; i < 60; ++i) {
        auto reply = flood.read();
        ASSERT_TRUE(reply.has_value());
        if (reply->header.kind() == wire::ERROR) {
          EXPECT_EQ(reply->header.error_code(), static_cast<int>(rpc::ErrorCode::kResourceExhausted));
          EXPECT_NE(reply->header.error().find("max_queued_requests"), std::string::npos);
          ++refused;
        } else {
          ++answered;
        }
      }
      EXPECT_GT(refused, 0);
      EXPECT_GE(answered, 16);
    }
    expect_serves("worker1");
  }
  rpc::shutdown();
}

// A caller whose large requests pile up behind a slow function has its
// stream read only while they hold max_pending_request_bytes_per_stream:
// the callee holds a few of them at a time, not all, and answers them all.
// Over gRPC, the stream's flow-control window holds more on top, as wide
// as gRPC's bandwidth-delay probe makes it (16-31 MiB on a 2-CPU VM) and
// nothing else bounds it here (the resource quota is far above).
MULTIPROCESS_TEST(HostileInputTest, PendingRequestBytesPauseTheStream, 3) {
  rpc::RpcBackendOptions options = mp::backend_options();
  options.num_worker_threads = 2;
  options.max_pending_request_bytes_per_stream = 8 << 20;
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, options);
  auto* store = &rpc::current_agent()->store();
  constexpr int kCalls = 384;
  if (mp::rank() == 0) {
    store->get("measured_before");
    const std::string big(1 << 20, 'b');
    std::vector<rpc::Future<int64_t>> calls;
    for (int i = 0; i < kCalls; ++i) {
      calls.push_back(rpc::rpc_async<int64_t>("worker1", "hold_string", big, int64_t{20}));
    }
    store->set("flooding", "1");
    for (auto& f : calls) {
      ASSERT_TRUE(f.wait_for(absl::Seconds(60)));
      EXPECT_EQ(f.value(), int64_t{1} << 20);
    }
    store->set("flood_done", "1");
  } else if (mp::rank() == 2) {
    auto mib = [](const std::string& both, int i) {
      int64_t v = -1;
      EXPECT_TRUE(absl::SimpleAtoi(std::vector<std::string>(absl::StrSplit(both, ' ')).at(i), &v));
      return v;
    };
    const std::string before = rpc::rpc_sync<std::string>("worker1", "memory_mib");
    rpc::rpc_sync<int64_t>("worker1", "start_sampling");
    store->set("measured_before", "1");
    store->get("flood_done");
    const std::string most = rpc::rpc_sync<std::string>("worker1", "stop_sampling");
    std::printf("memory of the called worker during %d calls of 1 MiB, in MiB: allocated %ld "
                "before, at most %ld; resident %ld before, at most %ld\n",
                kCalls, static_cast<long>(mib(before, 0)), static_cast<long>(mib(most, 0)),
                static_cast<long>(mib(before, 1)), static_cast<long>(mib(most, 1)));
#if !defined(__SANITIZE_ADDRESS__)
    // All of them held at once would be 384 MiB; the bound is half that,
    // room for gRPC's window on a machine where its probe widens it more.
    // It is on allocated bytes: resident memory also keeps what the
    // allocator's arenas hold freed.
    EXPECT_LT(mib(most, 0) - mib(before, 0), kCalls / 2) << "MiB allocated before and at most: "
                                                 << before << ", " << most;
#endif
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(HostileInputTest, ForgedRRefMessagesAreRefused, 3) {
  rpc::RpcBackendOptions options = mp::backend_options();
  options.rpc_timeout = absl::Seconds(2);  // unknown RRefs fail after this
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, options);
  auto store = [] { return &rpc::current_agent()->store(); };
  if (mp::rank() == 2) {
    {
      // The RRef lives on worker1; worker2 holds its creator's fork.
      auto rref = rpc::remote<at::Tensor>("worker1", "add", at::ones({2}), at::ones({2}));
      EXPECT_TRUE(at::equal(rref.to_here(), at::full({2}, 2.0)));
      const auto& s = rref.state();
      store()->set("rref", absl::StrCat(s.id.worker, " ", s.id.local));
      store()->get("attacked");
      // The forged delete of our fork did not take the value away.
      EXPECT_TRUE(at::equal(rref.to_here(), at::full({2}, 2.0)));
      store()->set("checked", "1");
    }
    store()->set("dropped", "1");
  }
  if (mp::rank() == 0) {
    const std::string victim = address_of("worker1");
    std::vector<std::string> id = absl::StrSplit(store()->get("rref"), ' ');
    int64_t w, l;
    ASSERT_TRUE(absl::SimpleAtoi(id[0], &w) && absl::SimpleAtoi(id[1], &l));
    auto call = [&](const std::string& function, std::vector<c10::IValue> args) {
      RawStream stream(victim, victim_id(), 0);
      EXPECT_TRUE(stream.write_bytes(
          rpc::testing::frame_bytes(rpc::testing::request_frame(0, 7, function, std::move(args)))));
      auto reply = stream.read();
      EXPECT_TRUE(reply.has_value());
      return reply ? *reply : rpc::internal::Frame();
    };
    auto expect_refused = [](const rpc::internal::Frame& reply, rpc::ErrorCode code,
                             const std::string& needle) {
      EXPECT_EQ(reply.header.kind(), wire::ERROR);
      EXPECT_EQ(reply.header.error_code(), static_cast<int>(code)) << reply.header.error();
      EXPECT_NE(reply.header.error().find(needle), std::string::npos) << reply.header.error();
    };
    // Deleting worker2's fork (the creator's: same id) as worker0.
    expect_refused(call("__rref.del_fork", {w, l, w, l}), rpc::ErrorCode::kPermissionDenied,
                   "held by worker 2");
    // Adding a fork named by another worker; creating an RRef named by another.
    expect_refused(call("__rref.add_fork", {w, l, int64_t{2}, int64_t{999}, int64_t{0}}),
                   rpc::ErrorCode::kPermissionDenied, "cannot add a fork made by worker 2");
    expect_refused(call("__rref.create", {int64_t{2}, int64_t{999}, int64_t{2}, int64_t{999},
                                          std::string("function"), std::string("add"), int64_t{-1},
                                          int64_t{0}, c10::IValue(c10::ivalue::Tuple::create({}))}),
                   rpc::ErrorCode::kPermissionDenied, "cannot create");
    // Ids no worker could have made fail at once; one that could have, once
    // its creation has not come within the RPC timeout, instead of pinning
    // the call forever.
    expect_refused(call("__rref.fetch", {int64_t{9}, int64_t{1}}), rpc::ErrorCode::kInvalidArgument,
                   "not one of the 3 workers");
    // An RRef made by a method of itself.
    expect_refused(call("__rref.create", {int64_t{0}, int64_t{1000}, int64_t{0}, int64_t{1000},
                                          std::string("method"), std::string("size"), int64_t{0},
                                          int64_t{1000}, c10::IValue(c10::ivalue::Tuple::create({}))}),
                   rpc::ErrorCode::kInvalidArgument, "would wait for its own");
    // The tensor RRef sent back to its owner claiming to be a Box: the
    // owner goes by what it holds.
    {
      rpc::internal::Frame forged = rpc::testing::request_frame(0, 7, "box_size", {});
      auto* ext = forged.header.mutable_payload()->mutable_tuple()->add_items()->mutable_ext();
      ext->set_type("rref");
      ext->set_data(absl::StrCat(w, " ", l, " 0 4242 1 Box"));
      RawStream stream(victim, victim_id(), 0);
      ASSERT_TRUE(stream.write_bytes(rpc::testing::frame_bytes(forged)));
      auto reply = stream.read();
      ASSERT_TRUE(reply.has_value());
      expect_refused(*reply, rpc::ErrorCode::kInvalidArgument, "not an object of class 'Box'");
      // Nor a huge one, split before it is checked.
      rpc::internal::Frame huge = rpc::testing::request_frame(0, 8, "box_size", {});
      auto* big = huge.header.mutable_payload()->mutable_tuple()->add_items()->mutable_ext();
      big->set_type("rref");
      big->set_data(std::string(8 << 20, ' '));
      ASSERT_TRUE(stream.write_bytes(rpc::testing::frame_bytes(huge)));
      reply = stream.read();
      ASSERT_TRUE(reply.has_value());
      expect_refused(*reply, rpc::ErrorCode::kMalformedMessage, "bytes on the wire");
    }
    absl::Time start = absl::Now();
    expect_refused(call("__rref.fetch", {int64_t{2}, int64_t{123456}}),
                   rpc::ErrorCode::kInvalidArgument, "never created");
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    // A delete of a fork nobody added (as if it overtook the add): taken,
    // and forgotten after the RPC timeout when no add comes.
    const rpc::internal::Frame early =
        call("__rref.del_fork", {w, l, int64_t{0}, int64_t{777}});
    EXPECT_NE(early.header.kind(), wire::ERROR) << early.header.error();
    store()->set("attacked", "1");
    store()->get("checked");
    expect_serves("worker1");
    // Once worker2 has dropped its handle, nothing pins the value.
    store()->get("dropped");
    int64_t owned = -1;
    const absl::Time until = absl::Now() + absl::Seconds(15);
    while ((owned = rpc::rpc_sync<int64_t>("worker1", "owned_rrefs")) != 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_EQ(owned, 0) << "RRefs still owned by worker1";
  }
  rpc::shutdown();
}

// Replies that break the protocol fail the calls on that connection (with
// an error naming the worker), not the caller. Worker 1 is a fake that
// answers every request with a bad reply of the kind the caller asks for.
std::string bad_reply(const rpc::internal::Frame& request) {
  wire::Header h;
  h.set_id(request.header.id());
  h.set_src(1);
  h.set_kind(wire::RESPONSE);
  const std::string& what = request.header.function();
  if (what == "dtype18") {
    h.mutable_payload()->set_tensor(0);
    auto* meta = h.add_tensors();
    meta->set_dtype(18);
    meta->add_sizes(2);
    meta->set_nbytes(8);
    return rpc::testing::raw_frame(h, std::string(8, '\0'));
  }
  if (what == "wrap") {
    h.mutable_payload()->set_tensor(0);
    auto* meta = h.add_tensors();
    meta->set_dtype(6);
    meta->add_sizes(int64_t{1} << 62);
    meta->set_nbytes(0);
    return rpc::testing::raw_frame(h);
  }
  if (what == "kind") {
    h.set_kind(wire::REQUEST);
    return rpc::testing::raw_frame(h);
  }
  if (what == "src") {
    h.set_src(0);
    h.mutable_payload()->set_i(1);
    return rpc::testing::raw_frame(h);
  }
  if (what == "code") {
    h.set_kind(wire::ERROR);
    h.set_error_code(12345);
    h.set_error("?");
    return rpc::testing::raw_frame(h);
  }
  if (what == "index") {
    h.mutable_payload()->set_tensor(3);
    return rpc::testing::raw_frame(h);
  }
  if (what == "events") {
    // A good result, and for the caller's profiler more than a million
    // empty remote events (two bytes each: field 2, length 0).
    h.mutable_payload()->set_i(42);
    auto* ext = h.add_ext();
    ext->set_key("profiler.events");
    std::string blob;
    for (int i = 0; i <= (1 << 20); ++i) blob.append("\x12\x00", 2);
    ext->set_value(std::move(blob));
    return rpc::testing::raw_frame(h);
  }
  h.mutable_payload()->set_i(42);  // "good"
  return rpc::testing::raw_frame(h);
}

}  // namespace

namespace {

// Serves the transport's stream method by hand on `cq` until the server
// shuts down, answering each request with bad_reply().
void serve_bad_replies(grpc::AsyncGenericService* service, grpc::ServerCompletionQueue* cq) {
  auto next = [cq](void* want) {
    void* got;
    bool ok;
    if (!cq->Next(&got, &ok)) return false;
    EXPECT_EQ(got, want);
    return ok;
  };
  int tags[4];
  while (true) {
    grpc::GenericServerContext ctx;
    grpc::GenericServerAsyncReaderWriter rw(&ctx);
    service->RequestCall(&ctx, &rw, cq, cq, &tags[0]);
    if (!next(&tags[0])) return;
    while (true) {
      grpc::ByteBuffer buffer;
      rw.Read(&buffer, &tags[1]);
      if (!next(&tags[1])) break;
      rpc::internal::Frame request;
      ASSERT_TRUE(rpc::internal::parse_frame(buffer, &request).ok());
      grpc::Slice slice(bad_reply(request));
      rw.Write(grpc::ByteBuffer(&slice, 1), &tags[2]);
      if (!next(&tags[2])) break;
    }
    rw.Finish(grpc::Status::OK, &tags[3]);
    next(&tags[3]);
  }
}

MULTIPROCESS_TEST(HostileInputTest, BadRepliesFailTheirCallsNotTheCaller, 2) {
  if (mp::rank() == 1) {
    // A fake worker1: it takes part in the rendezvous, then serves bad replies.
    grpc::AsyncGenericService service;
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterAsyncGenericService(&service);
    auto cq = builder.AddCompletionQueue();
    auto server = builder.BuildAndStart();
    ASSERT_TRUE(server);
    std::thread serving([&] { serve_bad_replies(&service, cq.get()); });
    rpc::Store store(std::getenv("MASTER_ADDR"), std::atoi(std::getenv("MASTER_PORT")),
                     absl::Seconds(60));
    store.set("rpc/worker/1", absl::StrCat("worker1\n127.0.0.1:", port));
    store.get("fake/done");
    for (const char* barrier : {"arrived", "drained", "departed"}) {
      store.set(absl::StrCat("rpc/shutdown/", barrier, "/1"), "1");
    }
    // Requests for calls made after the server's shutdown fail their tag, so
    // the serving loop ends; only then may the queue shut down.
    server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    serving.join();
    cq->Shutdown();
    void* tag;
    bool ok;
    while (cq->Next(&tag, &ok)) {
    }
    return;
  }
  rpc::init_rpc(mp::worker_name(), 0, 2, mp::backend_options());
  auto expect_failed = [](const std::string& function, rpc::ErrorCode code,
                          const std::string& needle) {
    auto f = rpc::rpc_async(rpc::CallOptions{absl::Seconds(10)}, "worker1", function);
    ASSERT_TRUE(f.wait_for(absl::Seconds(20))) << function;
    ASSERT_TRUE(f.has_error()) << function;
    try {
      f.value();
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("worker1"), std::string::npos) << e.what();
    }
    // A good reply on a new connection.
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "good"), 42);
  };
  expect_failed("dtype18", rpc::ErrorCode::kUnavailable, "unsupported dtype 18");
  expect_failed("wrap", rpc::ErrorCode::kUnavailable, "does not match its shape");
  expect_failed("kind", rpc::ErrorCode::kUnavailable, "sent a reply of kind 1");
  expect_failed("src", rpc::ErrorCode::kUnavailable, "claims to come from worker 0");
  expect_failed("code", rpc::ErrorCode::kMalformedMessage, "unknown error code 12345");
  expect_failed("index", rpc::ErrorCode::kMalformedMessage, "tensor index 3 out of range");
  {
    // Remote events past the profiler's bound are dropped, not parsed into
    // a hundred times their bytes; the call itself succeeds.
    rpc::profiler::Profile profile;
    const int64_t before = rpc::testing::resident_bytes() >> 20;
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "events"), 42);
    const int64_t after = rpc::testing::resident_bytes() >> 20;
    std::printf("caller's resident memory around a reply with 2 MiB of empty remote events: "
                "%ld MiB, then %ld MiB\n", static_cast<long>(before), static_cast<long>(after));
#if !defined(__SANITIZE_ADDRESS__)
    EXPECT_LT(after - before, 64) << "MiB resident before " << before << ", after " << after;
#endif
  }
  rpc::current_agent()->store().set("fake/done", "1");
  rpc::shutdown();
}

// An exception on any of the runtime's threads fails the call or stream at
// hand, is logged, and the thread goes on serving.
MULTIPROCESS_TEST(HostileInputTest, ExceptionsOnRuntimeThreadsFailOnlyTheirCall, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    // The arming call's own reply passes "agent.reply"; its request has
    // passed the other points already.
    auto arm_remote = [](const std::string& point) {
      rpc::rpc_sync<int64_t>("worker1", "arm_fault", point, int64_t{point == "agent.reply"});
    };
    auto fails_with = [](auto&& call, const std::string& needle) {
      try {
        call();
        ADD_FAILURE() << "no error; expected one with '" << needle << "'";
      } catch (const rpc::RpcError& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    at::Tensor t = at::ones({2});
    auto add_call = [&] { rpc::rpc_sync<at::Tensor>("worker1", "add", t, t); };

    // The callee's request handling (inline or on the pool).
    arm_remote("agent.serve");
    fails_with(add_call, "injected fault at agent.serve");
    expect_serves("worker1");
    // Past the callee, before the handler, more times than the worker has
    // threads: each call fails, and no thread's slot is lost.
    for (int i = 0; i < 20; ++i) {
      arm_remote("agent.dispatch");
      fails_with(add_call, "injected fault at agent.dispatch");
    }
    expect_serves("worker1");
    // The callee's transport thread reading the request.
    arm_remote("transport.server_read");
    fails_with(add_call, "injected fault at transport.server_read");
    expect_serves("worker1");
    // The reply sender (an async result completed outside any request).
    arm_remote("agent.reply");
    fails_with([] { rpc::rpc_sync<int64_t>("worker1", "later", 20); }, "injected fault at agent.reply");
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "later", 20), 20);
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "fault_count", std::string("agent.reply")), 1);
    // The caller's thread reading the reply.
    rpc::internal::arm_fault("transport.client_read");
    fails_with(add_call, "injected fault at transport.client_read");
    expect_serves("worker1");
    // The caller's timer, failing a call whose deadline passed.
    rpc::internal::arm_fault("agent.timer");
    fails_with([] { rpc::rpc_sync<int64_t>(rpc::CallOptions{absl::Milliseconds(50)}, "worker1",
                                           "sleep_ms", 1000); },
               "timed out");
    EXPECT_EQ(rpc::internal::fault_count("agent.timer"), 1);
    expect_serves("worker1");
    // The store's handler (this rank hosts the store).
    rpc::internal::arm_fault("store.request");
    EXPECT_THROW(rpc::current_agent()->store().set("k", "v"), rpc::RpcError);
    rpc::current_agent()->store().set("k", "v");
    EXPECT_EQ(rpc::current_agent()->store().get("k"), "v");
  }
  rpc::shutdown();
}

// A store client that sends half a request and keeps its connection, or
// asks for more than the store holds, does not stop it serving others.
int connect_to(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

std::string http2_frame(uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload) {
  std::string f;
  f.push_back(static_cast<char>(payload.size() >> 16));
  f.push_back(static_cast<char>(payload.size() >> 8));
  f.push_back(static_cast<char>(payload.size()));
  f.push_back(static_cast<char>(type));
  f.push_back(static_cast<char>(flags));
  for (int i = 3; i >= 0; --i) f.push_back(static_cast<char>(stream >> (8 * i)));
  return f + payload;
}

// HPACK literal header field without indexing, plain strings.
std::string hpack(const std::string& name, const std::string& value) {
  return std::string(1, '\0') + static_cast<char>(name.size()) + name +
         static_cast<char>(value.size()) + value;
}

MULTIPROCESS_TEST(HostileInputTest, StoreSurvivesHostileClients, 1) {
  auto server = rpc::StoreServer::start("127.0.0.1", 0);
  const int port = server->port();
  // Half a Set request: headers, then 10 of the 100 bytes its message claims.
  std::vector<int> idle;
  for (int i = 0; i < 20; ++i) {
    int fd = connect_to(port);
    ASSERT_GE(fd, 0);
    std::string out = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    out += http2_frame(0x4, 0, 0, "");  // SETTINGS
    std::string headers = hpack(":method", "POST") + hpack(":scheme", "http") +
                          hpack(":path", "/ddprpc.wire.Store/Set") + hpack(":authority", "x") +
                          hpack("content-type", "application/grpc") + hpack("te", "trailers");
    out += http2_frame(0x1, 0x4, 1, headers);  // HEADERS, END_HEADERS
    std::string data("\0\0\0\0\x64", 5);
    data += std::string(10, 'x');
    out += http2_frame(0x0, 0, 1, data);  // DATA, stream left open
    ASSERT_EQ(::write(fd, out.data(), out.size()), static_cast<ssize_t>(out.size()));
    idle.push_back(fd);
  }
  rpc::Store store("127.0.0.1", port, absl::Seconds(5));
  absl::Time start = absl::Now();
  store.set("a", "1");
  EXPECT_EQ(store.get("a"), "1");
  EXPECT_EQ(store.add("n", 5), 5);
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  // Requests beyond the store's bounds are refused with a reason.
  auto refused = [&](auto&& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "not refused: " << needle;
    } catch (const rpc::RpcError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused([&] { store.set("big", std::string(2 << 20, 'x')); }, "(at most 1048576)");
  refused([&] { store.set(std::string(5000, 'k'), "v"); }, "key of 5000 bytes");
  refused([&] { store.add("a2", 1), store.set("a2", "x"), store.add("a2", 1); }, "integer");
  const std::string value(1048000, 'x');  // 64 of them nearly fill the store's 64 MiB
  for (int i = 0; i < 64; ++i) store.set(absl::StrCat("fill", i), value);
  refused([&] { store.set("one more", value); }, "bytes already");
  EXPECT_EQ(store.get("a"), "1");
  for (int fd : idle) ::close(fd);
}

}  // namespace
