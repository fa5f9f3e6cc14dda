// The RPC profiler across real worker processes on loopback: event names and
// node ids, remote operators, nested calls, the table, the Chrome trace, and
// independent scopes on two threads.
#include "rpc/profiler/profiler.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/add.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/ones.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/barrier.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "rpc/rref/rref.h"
#include "tests/multiprocess.h"

namespace rpc = ddprpc::rpc;
namespace prof = ddprpc::rpc::profiler;
namespace mp = ddprpc::testing;

namespace {

at::Tensor add(at::Tensor a, at::Tensor b) { return at::add(a, b); }
DDPRPC_REGISTER_FUNCTION(add);

at::Tensor mul(at::Tensor a, at::Tensor b) { return at::mul(a, b); }
DDPRPC_REGISTER_FUNCTION(mul);

// Sleeps, then runs two operators.
at::Tensor slow_ops(int64_t sleep_ms) {
  absl::SleepFor(absl::Milliseconds(sleep_ms));
  at::Tensor t = at::ones({3, 3});
  return at::mul(at::add(t, t), t);
}
DDPRPC_REGISTER_FUNCTION(slow_ops);

// Nested: the callee calls a third worker.
at::Tensor relay(std::string to, at::Tensor t) { return rpc::rpc_sync<at::Tensor>(to, "add", t, t); }
DDPRPC_REGISTER_FUNCTION(relay);

// Whether the callee records for the caller right now.
bool callee_profiling() { return prof::is_profiling(); }
DDPRPC_REGISTER_FUNCTION(callee_profiling);

// An async function: its operators run before it returns the future.
rpc::Future<at::Tensor> async_add(at::Tensor a) {
  return rpc::make_ready_future(at::add(a, a));
}
DDPRPC_REGISTER_FUNCTION(async_add);

// Runs slow_ops on `to` (a caller that does not profile).
at::Tensor call_slow_ops(std::string to) { return rpc::rpc_sync<at::Tensor>(to, "slow_ops", int64_t{0}); }
DDPRPC_REGISTER_FUNCTION(call_slow_ops);

// A process-wide profile on this worker, started and reported over RPC.
std::unique_ptr<prof::ServerProfile> g_server_profile;
bool start_server_profile() {
  g_server_profile = std::make_unique<prof::ServerProfile>(prof::ProfileOptions{true, false});
  try {
    prof::ServerProfile second;
    return false;
  } catch (const std::logic_error&) {
    return true;  // one at a time
  }
}
DDPRPC_REGISTER_FUNCTION(start_server_profile);
// "name@node count shapes" per row of the stopped profile, grouped by shapes.
std::vector<std::string> stop_server_profile() {
  g_server_profile->stop();
  std::vector<std::string> rows;
  const prof::KeyAverages averages = g_server_profile->key_averages(true);
  for (const auto& row : averages.rows()) {
    rows.push_back(absl::StrCat(row.name, "@", row.node, " ", row.count, " ", row.input_shapes));
  }
  g_server_profile.reset();
  return rows;
}
DDPRPC_REGISTER_FUNCTION(stop_server_profile);

void init(int world_size) { rpc::init_rpc(mp::worker_name(), mp::rank(), world_size, mp::backend_options()); }

const prof::Event* find(const std::vector<prof::Event>& events, const std::string& name) {
  for (const auto& e : events) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

std::string names_of(const std::vector<prof::Event>& events) {
  std::string out;
  for (const auto& e : events) out += "  " + e.name + " @" + std::to_string(e.node) + "\n";
  return out;
}

MULTIPROCESS_TEST(ProfilerTest, SyncAsyncRemoteEventsNamesAndNodes, 3) {
  init(3);
  if (mp::rank() == 0) {
    at::Tensor x = at::ones({4});
    prof::Profile p;
    at::Tensor local = at::mul(x, x);  // a local operator in the scope
    rpc::rpc_sync<at::Tensor>("worker1", "add", x, x);
    rpc::Future<at::Tensor> f = rpc::rpc_async<at::Tensor>("worker2", "slow_ops", int64_t{50});
    rpc::RRef<at::Tensor> r = rpc::remote<at::Tensor>("worker1", "mul", x, x);
    rpc::Future<at::Tensor> a = rpc::rpc_async<at::Tensor>("worker2", "async_add", x);
    f.wait();
    a.wait();
    r.to_here();
    p.stop();
    const auto events = p.events();
    SCOPED_TRACE(names_of(events));

    const prof::Event* sync = find(events, "rpc_sync#add(worker0 -> worker1)");
    ASSERT_NE(sync, nullptr);
    EXPECT_TRUE(sync->rpc);
    EXPECT_EQ(sync->node, 0);
    const prof::Event* sync_op = find(events, "rpc_sync#add(worker0 -> worker1)#remote_op: aten::add");
    ASSERT_NE(sync_op, nullptr);
    EXPECT_EQ(sync_op->node, 1);
    EXPECT_FALSE(sync_op->rpc);
    // Remote operators are placed inside the call's span, on the caller's clock.
    EXPECT_GE(sync_op->start_ns, sync->start_ns);
    EXPECT_LE(sync_op->start_ns + sync_op->duration_ns, sync->start_ns + sync->duration_ns);

    const prof::Event* async = find(events, "rpc_async#slow_ops(worker0 -> worker2)");
    ASSERT_NE(async, nullptr);
    EXPECT_EQ(async->node, 0);
    EXPECT_GE(async->duration_ns, 50'000'000);  // until the future completed
    for (const char* op : {"aten::ones", "aten::add", "aten::mul"}) {
      const prof::Event* e = find(events, std::string("rpc_async#slow_ops(worker0 -> worker2)#remote_op: ") + op);
      ASSERT_NE(e, nullptr) << op;
      EXPECT_EQ(e->node, 2);
      // After the callee's 50 ms sleep.
      EXPECT_GE(e->start_ns, async->start_ns + 45'000'000) << op;
    }
    const prof::Event* async_fn = find(events, "rpc_async#async_add(worker0 -> worker2)#remote_op: aten::add");
    ASSERT_NE(async_fn, nullptr);
    EXPECT_EQ(async_fn->node, 2);

    const prof::Event* remote = find(events, "remote#mul(worker0 -> worker1)");
    ASSERT_NE(remote, nullptr);
    EXPECT_EQ(remote->node, 0);
    const prof::Event* remote_op = find(events, "remote#mul(worker0 -> worker1)#remote_op: aten::mul");
    ASSERT_NE(remote_op, nullptr);
    EXPECT_EQ(remote_op->node, 1);

    const prof::Event* local_op = find(events, "aten::mul");
    ASSERT_NE(local_op, nullptr);
    EXPECT_EQ(local_op->node, 0);
    EXPECT_GT(local_op->duration_ns, 0);
    // Nothing ran on worker2 for the sync call to worker1.
    for (const auto& e : events) {
      if (absl::StartsWith(e.name, "rpc_sync#add(worker0 -> worker1)#")) {
        EXPECT_EQ(e.node, 1) << e.name;
      }
    }
    // Self time never exceeds total time; RPC spans have none.
    for (const auto& e : events) {
      EXPECT_LE(e.self_ns, e.duration_ns) << e.name;
      if (e.rpc) {
        EXPECT_EQ(e.self_ns, 0) << e.name;
      }
    }
    EXPECT_EQ(p.node_names().at(2), "worker2");
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(ProfilerTest, NestedCallsKeepTheirPathAndNodes, 3) {
  init(3);
  if (mp::rank() == 0) {
    prof::Profile p;
    rpc::rpc_sync<at::Tensor>("worker1", "relay", "worker2", at::ones({4}));
    p.stop();
    const auto events = p.events();
    SCOPED_TRACE(names_of(events));
    const std::string outer = "rpc_sync#relay(worker0 -> worker1)";
    const std::string inner = outer + "#remote_op: rpc_sync#add(worker1 -> worker2)";
    const prof::Event* o = find(events, outer);
    const prof::Event* i = find(events, inner);
    const prof::Event* op = find(events, inner + "#remote_op: aten::add");
    ASSERT_NE(o, nullptr);
    ASSERT_NE(i, nullptr);
    ASSERT_NE(op, nullptr);
    EXPECT_EQ(o->node, 0);
    EXPECT_EQ(i->node, 1);  // worker1 made the nested call
    EXPECT_TRUE(i->rpc);
    EXPECT_EQ(op->node, 2);  // and worker2 ran the add
    EXPECT_EQ(p.node_names().at(2), "worker2");
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(ProfilerTest, CalleeRecordsOnlyProfiledCalls, 2) {
  init(2);
  if (mp::rank() == 0) {
    EXPECT_FALSE(rpc::rpc_sync<bool>("worker1", "callee_profiling"));
    {
      prof::Profile p;
      EXPECT_TRUE(prof::is_profiling());
      EXPECT_TRUE(rpc::rpc_sync<bool>("worker1", "callee_profiling"));
    }
    EXPECT_FALSE(prof::is_profiling());
    EXPECT_FALSE(rpc::rpc_sync<bool>("worker1", "callee_profiling"));
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(ProfilerTest, TableCountsAndSorts, 2) {
  init(2);
  if (mp::rank() == 0) {
    at::Tensor x = at::ones({4});
    // Connect first: the first call's connection setup (several ms, more on
    // a loaded machine) would otherwise compete with the 20 ms call below.
    rpc::rpc_sync<at::Tensor>("worker1", "add", x, x);
    prof::Profile p;
    for (int i = 0; i < 3; ++i) rpc::rpc_sync<at::Tensor>("worker1", "add", x, x);
    rpc::rpc_sync<at::Tensor>("worker1", "slow_ops", int64_t{20});
    p.stop();
    prof::KeyAverages averages = p.key_averages();
    bool found = false;
    for (const auto& row : averages.rows()) {
      if (row.name == "rpc_sync#add(worker0 -> worker1)") {
        found = true;
        EXPECT_EQ(row.count, 3);
        EXPECT_EQ(row.node, 0);
      }
      if (row.name == "rpc_sync#add(worker0 -> worker1)#remote_op: aten::add") {
        EXPECT_EQ(row.count, 3);
        EXPECT_EQ(row.node, 1);
      }
    }
    EXPECT_TRUE(found);
    const std::string table = averages.table("cpu_time_total", 2);
    SCOPED_TRACE(table);
    for (const char* header : {"Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total",
                               "CPU time avg", "# of Calls", "Node ID", "Self CPU time total:"}) {
      EXPECT_NE(table.find(header), std::string::npos) << header;
    }
    // Sorted by total time: the 20 ms call first; two rows only.
    std::istringstream lines(table);
    std::vector<std::string> rows;
    for (std::string line; std::getline(lines, line);) {
      if (!line.empty() && line[0] != '-' && line.find("Node ID") == std::string::npos &&
          !absl::StartsWith(line, "Self CPU time total")) {
        rows.push_back(line);
      }
    }
    ASSERT_EQ(rows.size(), 2u);
    EXPECT_NE(rows[0].find("rpc_sync#slow_ops(worker0 -> worker1)"), std::string::npos);
    EXPECT_THROW(averages.table("bogus"), std::invalid_argument);
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(ProfilerTest, InputShapesAndMemoryOnBothSides, 2) {
  init(2);
  if (mp::rank() == 0) {
    at::Tensor a = at::ones({4, 8}), big = at::ones({16, 32});
    rpc::rpc_sync<at::Tensor>("worker1", "add", a, a);  // connected before profiling
    prof::Profile p(prof::ProfileOptions{/*record_shapes=*/true, /*profile_memory=*/true});
    at::Tensor local = at::add(a, a);
    at::Tensor made = at::ones({2, 16});  // aten::ones allocates through aten::empty
    at::Tensor remote = rpc::rpc_sync<at::Tensor>("worker1", "add", big, big);
    p.stop();
    const std::vector<prof::Event> events = p.events();
    SCOPED_TRACE(names_of(events));
    const prof::Event* add = find(events, "aten::add");
    ASSERT_NE(add, nullptr);
    EXPECT_EQ(add->input_shapes, (std::vector<std::vector<int64_t>>{{4, 8}, {4, 8}, {}}));
    EXPECT_EQ(add->cpu_memory_usage, 4 * 8 * 4);
    const prof::Event* ones = find(events, "aten::ones");
    const prof::Event* empty = find(events, "aten::empty");
    ASSERT_NE(ones, nullptr);
    ASSERT_NE(empty, nullptr);
    EXPECT_EQ(ones->cpu_memory_usage, 2 * 16 * 4);
    EXPECT_EQ(ones->self_cpu_memory_usage, 0);
    EXPECT_EQ(empty->self_cpu_memory_usage, 2 * 16 * 4);
    const prof::Event* remote_add = find(events, "rpc_sync#add(worker0 -> worker1)#remote_op: aten::add");
    ASSERT_NE(remote_add, nullptr);
    EXPECT_EQ(remote_add->node, 1);
    EXPECT_EQ(remote_add->input_shapes, (std::vector<std::vector<int64_t>>{{16, 32}, {16, 32}, {}}));
    EXPECT_EQ(remote_add->cpu_memory_usage, 16 * 32 * 4);

    // Grouped by shapes: the table has the memory and shape columns.
    const std::string table = p.key_averages(/*group_by_input_shape=*/true).table("cpu_memory_usage");
    SCOPED_TRACE(table);
    for (const char* text : {"CPU Mem", "Self CPU Mem", "Input Shapes", "[[4, 8], [4, 8], []]",
                             "[[16, 32], [16, 32], []]", "2.00 Kb"}) {
      EXPECT_NE(table.find(text), std::string::npos) << text;
    }

    // Without the options: neither shapes nor memory, nor their columns.
    prof::Profile plain;
    at::add(a, a);
    plain.stop();
    const std::vector<prof::Event> plain_events = plain.events();
    const prof::Event* bare = find(plain_events, "aten::add");
    ASSERT_NE(bare, nullptr);
    EXPECT_TRUE(bare->input_shapes.empty());
    EXPECT_EQ(bare->cpu_memory_usage, 0);
    EXPECT_EQ(plain.key_averages().table().find("CPU Mem"), std::string::npos);
  }
  rpc::shutdown();
}

// The callee's process-wide profile sees every request it serves while it
// runs, from callers that profile and from callers that do not.
MULTIPROCESS_TEST(ProfilerTest, ServerProfileRecordsEveryServedRequest, 3) {
  init(3);
  if (mp::rank() == 0) {
    at::Tensor x = at::ones({3, 3});
    rpc::rpc_sync<at::Tensor>("worker1", "add", x, x);  // before: not recorded
    ASSERT_TRUE(rpc::rpc_sync<bool>("worker1", "start_server_profile"));
    rpc::rpc_sync<at::Tensor>("worker2", "call_slow_ops", std::string("worker1"));
    prof::Profile mine;
    rpc::rpc_sync<at::Tensor>("worker1", "slow_ops", int64_t{0});
    mine.stop();
    const std::vector<std::string> rows =
        rpc::rpc_sync<std::vector<std::string>>("worker1", "stop_server_profile");
    rpc::rpc_sync<at::Tensor>("worker1", "add", x, x);  // after: not recorded
    std::string all;
    for (const auto& r : rows) all += "  " + r + "\n";
    SCOPED_TRACE(all);
    auto has = [&](const std::string& prefix) {
      return std::count_if(rows.begin(), rows.end(),
                           [&](const std::string& r) { return absl::StartsWith(r, prefix); });
    };
    EXPECT_EQ(has("rpc_request#slow_ops(worker2 -> worker1)@1 1"), 1);
    EXPECT_EQ(has("rpc_request#slow_ops(worker0 -> worker1)@1 1"), 1);
    EXPECT_EQ(has("aten::mul@1 2 [[3, 3], [3, 3]]"), 1);
    EXPECT_EQ(has("rpc_request#add"), 0);
    EXPECT_EQ(has("rpc_request#stop_server_profile"), 0);
    // The caller that profiled still got the callee's operators.
    const std::vector<prof::Event> my_events = mine.events();
    EXPECT_NE(find(my_events, "rpc_sync#slow_ops(worker0 -> worker1)#remote_op: aten::mul"),
              nullptr);
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(ProfilerTest, ChromeTraceIsJsonWithOneProcessPerNode, 2) {
  init(2);
  if (mp::rank() == 0) {
    at::Tensor x = at::ones({4});
    prof::Profile p;
    at::add(x, x);
    rpc::rpc_async<at::Tensor>("worker1", "add", x, x).wait();
    p.stop();
    const std::string path = ::testing::TempDir() + "/profiler_trace.json";
    p.export_chrome_trace(path);
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    google::protobuf::Struct trace;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(text.str(), &trace).ok()) << text.str();
    const auto& list = trace.fields().at("traceEvents").list_value();
    bool begin = false, end = false, remote = false, local = false, node1_named = false;
    for (const auto& v : list.values()) {
      const auto& f = v.struct_value().fields();
      const std::string ph = f.at("ph").string_value();
      const std::string name = f.at("name").string_value();
      const int pid = static_cast<int>(f.at("pid").number_value());
      if (ph == "M" && name == "process_name" && pid == 1) {
        node1_named = absl::StrContains(
            f.at("args").struct_value().fields().at("name").string_value(), "worker1");
      }
      if (name == "rpc_async#add(worker0 -> worker1)") {
        EXPECT_EQ(pid, 0);
        begin |= ph == "b";
        end |= ph == "e";
      }
      if (name == "rpc_async#add(worker0 -> worker1)#remote_op: aten::add") {
        EXPECT_EQ(ph, "X");
        EXPECT_EQ(pid, 1);  // on the callee's row
        EXPECT_GT(f.at("dur").number_value(), 0);
        remote = true;
      }
      if (name == "aten::add") {
        EXPECT_EQ(pid, 0);
        local = true;
      }
    }
    EXPECT_TRUE(begin && end);
    EXPECT_TRUE(remote);
    EXPECT_TRUE(local);
    EXPECT_TRUE(node1_named);
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(ProfilerTest, QueuedRequestsLineUpSeriallyOnTheCallee, 2) {
  rpc::RpcBackendOptions options = mp::backend_options();
  options.num_worker_threads = 1;  // the callee runs one request at a time
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, options);
  if (mp::rank() == 0) {
    prof::Profile p;
    std::vector<rpc::Future<at::Tensor>> futures;
    for (int i = 0; i < 3; ++i) {
      futures.push_back(rpc::rpc_async<at::Tensor>("worker1", "slow_ops", int64_t{400}));
    }
    for (auto& f : futures) f.wait();
    p.stop();
    const auto events = p.events();
    SCOPED_TRACE(names_of(events));
    std::vector<int64_t> starts;
    for (const auto& e : events) {
      if (e.name == "rpc_async#slow_ops(worker0 -> worker1)#remote_op: aten::ones") {
        starts.push_back(e.start_ns);
      }
    }
    ASSERT_EQ(starts.size(), 3u);
    std::sort(starts.begin(), starts.end());
    // The callee runs the requests one after another (one worker thread),
    // so each request's operators come 400 ms (its sleep) after the
    // previous one's. Time spent queued on the callee is part of the
    // callee's span: taken for network time, half of it would move out of
    // the span and the operators would come only 200 ms apart. Each remote
    // span is centred in its round trip, so a delay on a loaded machine
    // (a thread that reads a request or a reply late) moves it by half the
    // delay: the bound, midway, leaves 200 ms of delay (CI, running two
    // multi-process tests on two cores, once showed 150 ms).
    EXPECT_GE(starts[1] - starts[0], 300'000'000);
    EXPECT_GE(starts[2] - starts[1], 300'000'000);
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(ProfilerTest, OverlappingScopesOnTwoThreadsDoNotMix, 2) {
  init(2);
  if (mp::rank() == 0) {
    absl::Barrier* started = new absl::Barrier(2);
    absl::Barrier* finished = new absl::Barrier(2);
    std::vector<prof::Event> events[2];
    auto run = [&](int which) {
      const char* fn = which == 0 ? "add" : "mul";
      at::Tensor x = at::ones({4});
      prof::Profile p;
      if (started->Block()) delete started;
      for (int i = 0; i < 20; ++i) {
        rpc::rpc_async<at::Tensor>("worker1", fn, x, x).wait();
        which == 0 ? at::add(x, x) : at::mul(x, x);
      }
      if (finished->Block()) delete finished;  // both scopes were open throughout
      p.stop();
      events[which] = p.events();
    };
    std::thread a(run, 0), b(run, 1);
    a.join();
    b.join();
    for (int which = 0; which < 2; ++which) {
      const std::string mine = which == 0 ? "add" : "mul";
      const std::string other = which == 0 ? "mul" : "add";
      SCOPED_TRACE(names_of(events[which]));
      int rpcs = 0;
      for (const auto& e : events[which]) {
        if (e.rpc) {
          ++rpcs;
          EXPECT_EQ(e.name, "rpc_async#" + mine + "(worker0 -> worker1)");
        } else if (e.node == 0) {
          EXPECT_NE(e.name, "aten::" + other);
        } else {
          EXPECT_TRUE(absl::StartsWith(e.name, "rpc_async#" + mine + "(")) << e.name;
        }
      }
      EXPECT_EQ(rpcs, 20);
      EXPECT_NE(find(events[which], "aten::" + mine), nullptr);
    }
  }
  rpc::shutdown();
}

}  // namespace
