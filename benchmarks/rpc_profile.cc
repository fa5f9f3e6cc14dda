// The "Profiling RPC-based workloads" recipe in C++: two workers; profile
// add and mul RPCs and a user function with operators (key_averages tables,
// remote operators with their node id), then use the profiler to tune
// num_worker_threads: 4 concurrent CPU-heavy RPCs against a callee with 1
// and with 8 worker threads. Writes a Chrome trace per run and renders each
// as a PNG timeline (benchmarks/reference/plot_trace.py, matplotlib).
#include <ATen/Parallel.h>
#include <ATen/ops/add.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/sigmoid.h>
#include <gflags/gflags.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "benchmarks/common.h"
#include "benchmarks/harness.h"
#include "rpc/profiler/profiler.h"
#include "rpc/rpc.h"

DEFINE_int32(udf_sleep_ms, 1000, "how long udf_with_ops sleeps before its operators");
DEFINE_int32(udf_size, 500, "num_workers_udf_with_ops works on a udf_size x udf_size tensor");
DEFINE_int32(udf_iters, 10, "loop iterations of num_workers_udf_with_ops (mul, add, relu, sigmoid)");
DEFINE_int32(calls, 4, "concurrent num_workers_udf_with_ops RPCs in the tuning example");
DEFINE_int32(row_limit, 12, "rows of the tuning tables");
DEFINE_string(trace_dir, "/tmp/rpc_profile", "where the Chrome traces and PNGs go");
DEFINE_string(json, "rpc_profile.json", "JSON results (relative: to the directory run from)");
DEFINE_string(phase, "", "internal: walkthrough (8 threads) or tuning (1 thread)");
DEFINE_int32(worker_threads, 8, "internal: the callee's num_worker_threads in this phase");

namespace rpc = ddprpc::rpc;
namespace prof = ddprpc::rpc::profiler;
namespace bench = ddprpc::benchmarks;

namespace {

// Wide enough for "rpc_async#num_workers_udf_with_ops(worker0 -> worker1)#remote_op: aten::sigmoid".
constexpr int kNameWidth = 82;

at::Tensor random_tensor() { return at::rand({3, 3}); }

at::Tensor add(at::Tensor a, at::Tensor b) { return at::add(a, b); }
DDPRPC_REGISTER_FUNCTION(add);

at::Tensor mul(at::Tensor a, at::Tensor b) { return at::mul(a, b); }
DDPRPC_REGISTER_FUNCTION(mul);

void udf_with_ops() {
  absl::SleepFor(absl::Milliseconds(FLAGS_udf_sleep_ms));
  at::Tensor t1 = random_tensor(), t2 = random_tensor();
  at::add(t1, t2);
  at::mul(t1, t2);
}
DDPRPC_REGISTER_FUNCTION(udf_with_ops);

at::Tensor num_workers_udf_with_ops() {
  at::Tensor t = at::randn({FLAGS_udf_size, FLAGS_udf_size});
  for (int i = 0; i < FLAGS_udf_iters; ++i) {
    t.mul(t);
    t.add(t);
    t = t.relu();
    t = t.sigmoid();
  }
  return t;
}
DDPRPC_REGISTER_FUNCTION(num_workers_udf_with_ops);

std::string trace_path(const std::string& stem) {
  return absl::StrCat(bench::output_path(FLAGS_trace_dir), "/", stem, ".json");
}

// Rank 0 of the tuning example: `calls` concurrent RPCs, waited inside the scope.
double tuning(std::ostream& report) {
  prof::Profile p;
  const absl::Time start = absl::Now();
  std::vector<rpc::Future<at::Tensor>> futs;
  for (int i = 0; i < FLAGS_calls; ++i) {
    futs.push_back(rpc::rpc_async<at::Tensor>("worker1", "num_workers_udf_with_ops"));
  }
  for (auto& f : futs) f.wait();
  const double wall_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  p.stop();
  const std::string trace = trace_path(absl::StrCat("tuning_", FLAGS_worker_threads, "_threads"));
  p.export_chrome_trace(trace);
  report << "\n## num_worker_threads = " << FLAGS_worker_threads << ": " << FLAGS_calls
         << " concurrent rpc_async(num_workers_udf_with_ops), sorted by CPU total\n"
         << p.key_averages().table("cpu_time_total", FLAGS_row_limit, kNameWidth)
         << absl::StrFormat("all %d RPCs done after %.1f ms; trace: %s\n", FLAGS_calls, wall_ms,
                            trace);
  return wall_ms;
}

int worker() {
  at::set_num_threads(1);  // parallelism comes from RPC threads only
  rpc::RpcBackendOptions options = bench::backend_options();
  options.allow_insecure = bench::allow_insecure();
  options.num_worker_threads = FLAGS_worker_threads;
  const int rank = bench::env_rank();
  rpc::init_rpc(absl::StrCat("worker", rank), rank, 2, options);
  if (rank == 0) {
    std::ostringstream report;
    if (FLAGS_phase == "walkthrough") {
      at::Tensor t1 = random_tensor(), t2 = random_tensor();
      {
        prof::Profile p;
        auto fut1 = rpc::rpc_async<at::Tensor>("worker1", "add", t1, t2);
        auto fut2 = rpc::rpc_async<at::Tensor>("worker1", "mul", t1, t2);
        fut1.wait();  // RPCs must be awaited within the profiling scope
        fut2.wait();
        p.stop();
        report << "## rpc_async add and mul on worker1\n" << p.key_averages().table("", 100, kNameWidth);
        p.export_chrome_trace(trace_path("add_mul"));
        report << "trace: " << trace_path("add_mul") << "\n";
      }
      {
        prof::Profile p;
        rpc::rpc_async("worker1", "udf_with_ops").wait();
        p.stop();
        report << "\n## rpc_async udf_with_ops (sleeps " << FLAGS_udf_sleep_ms
               << " ms, then rand, add, mul)\n"
               << p.key_averages().table("", 100, kNameWidth);
        p.export_chrome_trace(trace_path("udf_with_ops"));
        report << "trace: " << trace_path("udf_with_ops") << "\n";
      }
    }
    std::ostringstream warmup;
    tuning(warmup);  // first calls (connections, allocations) stay out of the comparison
    const double wall_ms = tuning(report);
    bench::Json result;
    result.begin_object().key("report").value(report.str());
    result.key("wall_ms").value(wall_ms).end_object();
    std::string error;
    if (!bench::write_result(result, &error)) {
      std::fprintf(stderr, "rpc_profile: cannot hand the report back: %s\n", error.c_str());
    }
  }
  rpc::shutdown();
  return 0;
}

// Runs both workers for one phase; returns rank 0's report and wall time.
bool run_phase(int argc, char** argv, const std::string& phase, int threads, std::string* report,
               double* wall_ms) {
  bench::RolesOptions launch;
  launch.nprocs = 2;
  launch.args = {"--phase=" + phase, absl::StrCat("--worker_threads=", threads)};
  launch.timeout = absl::Minutes(5);
  // One OpenMP thread per RPC thread (the setting is per thread otherwise):
  // parallelism comes from num_worker_threads only.
  launch.env.push_back({"OMP_NUM_THREADS", "1"});
  std::fprintf(stderr, "rpc_profile: %s, callee num_worker_threads=%d ...\n", phase.c_str(),
               threads);
  const bench::RolesResult r = bench::run_roles(argc, argv, launch);
  if (!r.ok()) {
    std::fprintf(stderr, "rpc_profile: %s\n", r.exit_code != 0 ? r.message.c_str() : r.result_error.c_str());
    return false;
  }
  const bench::JsonValue* text = bench::json_at(r.result, {"report"});
  *report = text != nullptr ? text->string_value() : "";
  *wall_ms = bench::json_number(r.result, {"wall_ms"}, 0);
  return true;
}

int coordinator(int argc, char** argv) {
  const std::string dir = bench::output_path(FLAGS_trace_dir);
  std::string ignored;
  bench::run_command({"mkdir", "-p", dir}, &ignored);
  std::string report8, report1;
  double wall8 = 0, wall1 = 0;
  if (!run_phase(argc, argv, "walkthrough", 8, &report8, &wall8)) return 1;
  if (!run_phase(argc, argv, "tuning", 1, &report1, &wall1)) return 1;
  std::printf("\nrpc_profile: 2 workers on loopback, %d CPUs, 1 intra-op thread each\n\n",
              bench::cpu_count());
  // The seed's order: walkthrough, then 1 thread, then 8 threads.
  const size_t tuning_at = report8.find("\n## num_worker_threads");
  std::printf("%s", report8.substr(0, tuning_at).c_str());
  std::printf("%s", report1.c_str());
  if (tuning_at != std::string::npos) std::printf("%s", report8.substr(tuning_at).c_str());
  std::printf("\nnum_worker_threads 1 -> 8: %d concurrent RPCs %.1f ms -> %.1f ms (%.2fx)\n",
              FLAGS_calls, wall1, wall8, wall8 > 0 ? wall1 / wall8 : 0.0);

  std::vector<std::string> traces;
  for (const char* stem : {"tuning_1_threads", "tuning_8_threads", "udf_with_ops", "add_mul"}) {
    traces.push_back(absl::StrCat(dir, "/", stem, ".json"));
  }
  const std::string script = bench::source_path("benchmarks/reference/plot_trace.py");
  if (script.empty()) {
    std::printf("PNG timelines skipped: benchmarks/reference/plot_trace.py not found\n");
  } else {
    std::vector<std::string> cmd = {"/usr/bin/python3", script, "--same_scale=2"};
    cmd.insert(cmd.end(), traces.begin(), traces.end());
    std::string output;
    const int rc = bench::run_command(cmd, &output);
    if (rc == 0) {
      std::printf("%s", output.c_str());
    } else {
      std::printf("PNG timelines not rendered (needs /usr/bin/python3 with matplotlib: "
                  "apt-get install python3-matplotlib): %s\n",
                  output.c_str());
    }
  }

  bench::Json json;
  json.begin_object();
  json.key("benchmark").value("rpc_profile");
  json.key("config").begin_object();
  json.key("calls").value(FLAGS_calls);
  json.key("udf_size").value(FLAGS_udf_size);
  json.key("udf_iters").value(FLAGS_udf_iters);
  json.key("cpus").value(bench::cpu_count());
  json.end_object();
  json.key("tuning_wall_ms").begin_object();
  json.key("num_worker_threads_1").value(wall1);
  json.key("num_worker_threads_8").value(wall8);
  json.end_object();
  json.key("traces").begin_array();
  for (const auto& t : traces) json.value(t);
  json.end_array();
  json.end_object();
  const std::string path = bench::output_path(FLAGS_json);
  if (json.write(path)) std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace

// After main's one-time set-up; also where ranks forked by run_roles start.
int rank_main(int argc, char** argv) {
  bench::keep_freed_memory();
  bench::parse_flags(&argc, &argv, "benchmarks/rpc_profile");
  if (bench::env_rank() >= 0) return worker();
  return coordinator(argc, argv);
}

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "the PyTorch 'Profiling RPC-based workloads' recipe in C++: profiler tables, Chrome\n"
      "  traces and PNG timelines of add/mul RPCs, a user function, and num_worker_threads\n"
      "  1 vs 8 for 4 concurrent CPU-heavy RPCs\n"
      "  usage: rpc_profile [flags]");
  return bench::run_main(argc, argv, &rank_main);
}
