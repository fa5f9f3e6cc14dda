// rpc_pingpong: round-trip latency and pipelined throughput of ddprpc's RPC
// between two workers, next to PyTorch's own RPC measured in the same run
// (benchmarks/reference/rpc_pingpong.py with --python), and next to what a
// plain TCP socket pair moves between the same two processes.
//
//   ./bazelw run //benchmarks:rpc_pingpong
//   ./bazelw run //benchmarks:rpc_pingpong -- --hosts=2   # root: 2 network namespaces
//
// Rank 0 calls rpc_sync(identity, t) on rank 1 for 16 B, 64 KiB, 4 MiB and
// 64 MiB float tensors (p50/p90 microseconds), then issues pipelined
// rpc_async calls with 16 B (calls/s). Prints a table and writes JSON.
// --pairs=N runs N interleaved rounds (ours, then PyTorch's) and prints
// medians: the median of the rounds' figures, and of their ratios.
//
// By default both workers run on this host, on loopback, and each side
// takes its fastest path (ddprpc's same-host transport; TensorPipe's shm
// and cma). --network_path measures both sides' network paths instead:
// ddprpc over gRPC, PyTorch over TensorPipe's TCP transport and basic
// channel (uv, basic). --hosts=2 puts the two workers (and PyTorch's two)
// on two network namespaces joined by a bridge (network_hosts.h), each a
// host of its own to the other, and implies --network_path.
#include <ATen/ops/ones.h>
#include <gflags/gflags.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "benchmarks/common.h"
#include "benchmarks/harness.h"
#include "benchmarks/network_hosts.h"
#include "benchmarks/raw_tcp.h"
#include "benchmarks/rounds.h"
#include "rpc/rpc.h"
#include "rpc/rref/rref.h"

DECLARE_bool(same_host_transport);  // benchmarks/common.cc
DECLARE_uint64(bulk_min_bytes);     // benchmarks/common.cc
DECLARE_int32(spin_us);             // benchmarks/common.cc

DEFINE_int32(iters, 2000, "timed rpc_sync calls per small tensor size");
DEFINE_int32(big_iters, 200, "timed rpc_sync calls for the 4 MiB tensor");
DEFINE_int32(huge_iters, 20, "timed rpc_sync calls for the 64 MiB tensor (after 5 untimed)");
DEFINE_int32(warmup, 50, "untimed calls before each size");
DEFINE_int32(async_calls, 5000, "pipelined rpc_async calls for the throughput figure");
DEFINE_int32(num_worker_threads, 8, "callee threads (the PyTorch reference uses 8)");
DEFINE_string(json, "rpc_pingpong.json",
              "where to write the results (relative paths are relative to the directory "
              "bazel run was started from)");
DEFINE_string(pytorch_script, "",
              "PyTorch reference script; default: benchmarks/reference/rpc_pingpong.py from this "
              "binary's runfiles");
DEFINE_bool(pytorch, true, "also measure PyTorch's RPC (needs the Python of --python, with torch)");
DEFINE_bool(network_path, false,
            "measure both sides' network paths: ddprpc over gRPC (no same-host transport), "
            "PyTorch over TensorPipe's TCP transport and basic channel; implied by --hosts");
DEFINE_int32(hosts, 0,
             "run the two workers of each side on this many network namespaces on a bridge "
             "(2: one each; needs root); 0: both on this host's loopback");
DEFINE_bool(raw_tcp, true,
            "also time the same round trips over plain TCP socket pairs between the two ddprpc "
            "workers (the network's bound): one connection, and --raw_tcp_streams from 4 MiB up");
DEFINE_int32(pairs, 1,
             "rounds of interleaved runs: ddprpc's two workers, then PyTorch's; each figure "
             "printed is the median of the rounds', each ratio the median of the rounds' ratios, "
             "so that the machine's drift between runs falls on both sides alike");
DEFINE_int32(raw_tcp_streams, 3,
             "connections (each with a thread on both ends) that the second raw TCP figure "
             "splits 4 MiB and larger messages between");

namespace rpc = ddprpc::rpc;
namespace bench = ddprpc::benchmarks;

namespace {

at::Tensor identity(at::Tensor t) { return t; }
DDPRPC_REGISTER_FUNCTION(identity);

// Rank 1's end of the raw TCP round trips: connects to rank 0 (the
// rendezvous host) and echoes. 0, or -1 when the socket failed.
int64_t tcp_echo(int64_t port, int64_t streams, int64_t bytes, int64_t rounds, int64_t spin_us) {
  const char* host = std::getenv("MASTER_ADDR");
  const absl::Status s = bench::raw_tcp_echo(host ? host : "127.0.0.1", static_cast<int>(port),
                                             static_cast<int>(streams), bytes,
                                             static_cast<int>(rounds), static_cast<int>(spin_us));
  if (!s.ok()) std::fprintf(stderr, "rpc_pingpong: %s\n", s.ToString().c_str());
  return s.ok() ? 0 : -1;
}
DDPRPC_REGISTER_FUNCTION(tcp_echo);

// The same identity as a method of a remote object, called through an RRef.
struct Echo {
  at::Tensor identity(at::Tensor t) { return t; }
};
static auto echo_registration =
    rpc::register_class<Echo>("Echo").constructor<>().method("identity", &Echo::identity);

struct Sizes {
  const char* key;
  const char* label;
  int64_t numel;
};
constexpr Sizes kSizes[] = {
    {"sync_16B", "16 B", 4},
    {"sync_65536B", "64 KiB", 16384},
    {"sync_4194304B", "4 MiB", 1048576},
    {"sync_67108864B", "64 MiB", 16777216}};

bool network_path() { return FLAGS_network_path || FLAGS_hosts > 0; }

// Untimed and timed calls for a size (the reference script does the same).
int warmup_calls(int64_t numel) { return numel > (4 << 20) ? std::min(FLAGS_warmup, 5) : FLAGS_warmup; }
int timed_calls(int64_t numel) {
  return numel > (4 << 20) ? FLAGS_huge_iters : numel >= 1000000 ? FLAGS_big_iters : FLAGS_iters;
}

// Runs in each of the two worker processes.
int worker() {
  rpc::RpcBackendOptions options = bench::backend_options();
  options.allow_insecure = bench::allow_insecure();
  options.num_worker_threads = FLAGS_num_worker_threads;
  const char* master = std::getenv("MASTER_ADDR");
  options.listen_address = bench::local_address_towards(master ? master : "127.0.0.1");
  if (options.listen_address.empty()) {
    std::fprintf(stderr, "rpc_pingpong: no local address routes to %s\n", master);
    return 1;
  }
  rpc::init_rpc(absl::StrCat("w", bench::env_rank()), -1, 2, options);
  if (bench::env_rank() == 0) {
    std::map<std::string, double> results;
    for (const auto& size : kSizes) {
      std::fprintf(stderr, "rpc_pingpong: rpc_sync %s ...\n", size.label);
      at::Tensor t = at::ones({size.numel});
      const int warmup = warmup_calls(size.numel);
      for (int i = 0; i < warmup; ++i) rpc::rpc_sync<at::Tensor>("w1", "identity", t);
      const int n = timed_calls(size.numel);
      std::vector<double> lat;
      lat.reserve(n);
      for (int i = 0; i < n; ++i) {
        absl::Time start = absl::Now();
        rpc::rpc_sync<at::Tensor>("w1", "identity", t);
        lat.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
      }
      results[absl::StrCat(size.key, ".p50_us")] = bench::percentile(lat, 0.5);
      results[absl::StrCat(size.key, ".p90_us")] = bench::percentile(lat, 0.9);
      for (const int streams : {1, FLAGS_raw_tcp_streams}) {
        if (!FLAGS_raw_tcp || streams < 1 || (streams > 1 && size.numel < 1000000)) continue;
        std::fprintf(stderr, "rpc_pingpong: raw TCP %s, %d stream(s) ...\n", size.label, streams);
        lat.clear();
        bench::RawTcpListener listener;
        absl::Status s = bench::raw_tcp_listen(options.listen_address, &listener);
        if (s.ok()) {
          const int64_t bytes = size.numel * 4;
          rpc::Future<int64_t> echo =
              rpc::rpc_async<int64_t>("w1", "tcp_echo", int64_t{listener.port}, int64_t{streams},
                                      bytes, int64_t{warmup + n}, int64_t{FLAGS_spin_us});
          s = bench::raw_tcp_round_trips(listener, streams, bytes, warmup, n, &lat, FLAGS_spin_us);
          if (echo.value() != 0 && s.ok()) s = absl::UnavailableError("the echo failed");
        }
        const std::string key = absl::StrCat("tcp", streams == 1 ? "1" : "n", "_", size.key);
        if (s.ok()) {
          results[key + ".p50_us"] = bench::percentile(lat, 0.5);
          results[key + ".p90_us"] = bench::percentile(lat, 0.9);
        } else {
          std::fprintf(stderr, "rpc_pingpong: raw TCP %s: %s\n", size.label, s.ToString().c_str());
        }
      }
    }
    {
      std::fprintf(stderr, "rpc_pingpong: RRef method call 16 B ...\n");
      rpc::RRef<Echo> echo = rpc::remote<Echo>("w1");
      at::Tensor t = at::ones({4});
      for (int i = 0; i < FLAGS_warmup; ++i) echo.rpc_sync(&Echo::identity, t);
      std::vector<double> lat;
      for (int i = 0; i < FLAGS_iters; ++i) {
        absl::Time start = absl::Now();
        echo.rpc_sync(&Echo::identity, t);
        lat.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
      }
      results["rref_method_16B.p50_us"] = bench::percentile(lat, 0.5);
      results["rref_method_16B.p90_us"] = bench::percentile(lat, 0.9);
    }
    std::fprintf(stderr, "rpc_pingpong: %d pipelined rpc_async ...\n", FLAGS_async_calls);
    at::Tensor t = at::ones({4});
    absl::Time start = absl::Now();
    std::vector<rpc::Future<at::Tensor>> futures;
    futures.reserve(FLAGS_async_calls);
    for (int i = 0; i < FLAGS_async_calls; ++i) {
      futures.push_back(rpc::rpc_async<at::Tensor>("w1", "identity", t));
    }
    rpc::wait_all(futures);
    results["async_16B_calls_per_s"] =
        FLAGS_async_calls / absl::ToDoubleSeconds(absl::Now() - start);
    // Handed back as one JSON object of numbers.
    bench::JsonValue out;
    auto& fields = *out.mutable_struct_value()->mutable_fields();
    for (const auto& [k, v] : results) fields[k].set_number_value(v);
    std::string error;
    if (!bench::write_result(out, &error)) {
      std::fprintf(stderr, "rpc_pingpong: cannot hand the results back: %s\n", error.c_str());
    }
  }
  rpc::shutdown();
  return 0;
}

std::map<std::string, double> read_results(const bench::JsonValue& result) {
  std::map<std::string, double> out;
  for (const auto& [k, v] : result.struct_value().fields()) out[k] = v.number_value();
  return out;
}

// The reference script's report ({"sync_16B": {"p50_us": x, "p90_us": y},
// ..., "async_16B_calls_per_s": z}) in the keys of ours.
std::map<std::string, double> read_reference(const bench::JsonValue& report) {
  std::map<std::string, double> out;
  if (!report.has_struct_value()) return out;
  for (const auto& [k, v] : report.struct_value().fields()) {
    if (v.has_struct_value()) {
      for (const char* p : {"p50_us", "p90_us"}) {
        const double x = bench::json_number(v, {p});
        if (x >= 0) out[absl::StrCat(k, ".", p)] = x;
      }
    } else if (v.kind_case() == bench::JsonValue::kNumberValue) {
      out[k] = v.number_value();
    }
  }
  return out;
}

using Figures = std::map<std::string, double>;

// One figure of a run (0: it has none).
double figure(const Figures& f, const std::string& key) {
  const auto it = f.find(key);
  return it == f.end() ? 0 : it->second;
}

// Each figure's median over the rounds.
Figures medians(const std::vector<Figures>& rounds) {
  Figures out;
  for (const Figures& f : rounds) {
    for (const auto& [k, v] : f) out[k] = 0;
  }
  for (auto& [k, v] : out) {
    v = bench::median_over<Figures>(rounds, [&k = k](const Figures& f) { return figure(f, k); });
  }
  return out;
}

int coordinator(int argc, char** argv) {
  bench::RolesOptions launch;
  launch.nprocs = 2;
  launch.timeout = absl::Minutes(10);
  const std::unique_ptr<bench::NetworkHosts> hosts =
      bench::hosts_from_flag("rpc_pingpong", FLAGS_hosts);
  const std::string where = hosts ? hosts->describe() : "loopback";
  if (hosts) hosts->place(&launch);
  const std::string script =
      bench::reference_script(FLAGS_pytorch_script, "benchmarks/reference/rpc_pingpong.py");
  std::string pytorch_note;
  bench::RoundsPlan plan;
  plan.name = "rpc_pingpong";
  plan.rounds = FLAGS_pairs;
  plan.variants = {"ddprpc"};
  plan.with_theirs = FLAGS_pytorch && !script.empty();
  if (!plan.with_theirs) {
    pytorch_note = FLAGS_pytorch ? "PyTorch reference not run (reference script not found; pass "
                                   "--pytorch_script)"
                                 : "PyTorch reference not run (--pytorch=false)";
  }
  bench::Rounds<Figures> rounds;
  const int rc = bench::run_rounds<Figures>(
      plan,
      [&](const std::string&, int, Figures* ours) {
        std::fprintf(stderr, "rpc_pingpong: starting 2 ddprpc workers (%s)\n", where.c_str());
        const bench::RolesResult r = bench::run_roles(argc, argv, launch);
        if (!r.ok()) {
          std::fprintf(stderr, "rpc_pingpong: %s\n",
                       r.exit_code != 0 ? r.message.c_str() : r.result_error.c_str());
          return 1;
        }
        *ours = read_results(r.result);
        return 0;
      },
      [&](int, Figures* theirs) {
        std::fprintf(stderr, "rpc_pingpong: measuring PyTorch RPC with %s\n", script.c_str());
        std::vector<std::string> args = {absl::StrCat("--huge_iters=", FLAGS_huge_iters)};
        if (network_path()) args.push_back("--network_path");
        // PyTorch's two ranks are placed as ours were.
        bench::RolesOptions ranks = launch;
        ranks.master_port = 0;
        if (hosts) {
          // Each namespace's one interface, for TensorPipe and for the Gloo
          // group init_rpc makes.
          ranks.env.emplace_back("TP_SOCKET_IFNAME", "eth0");
          ranks.env.emplace_back("GLOO_SOCKET_IFNAME", "eth0");
        }
        const bench::ReferenceRun run =
            bench::run_reference_ranks(script, args, ranks, /*report_flag=*/"");
        *theirs = read_reference(run.report);
        if (run.ok() && !theirs->empty()) return true;
        pytorch_note = "PyTorch reference failed: " + run.failure();
        return false;
      },
      &rounds);
  if (rc != 0) return rc;
  const std::vector<Figures>& our_rounds = rounds.ours["ddprpc"];
  Figures ours = medians(our_rounds);
  Figures theirs = medians(rounds.theirs);
  const bool several = rounds.theirs.size() > 1;
  // The median of the rounds' ratios of one figure, and their list.
  auto round_ratios = [&](const std::string& key, bool higher_is_better) {
    return rounds.speedups(
        "ddprpc", [key](const Figures& f) { return figure(f, key); }, higher_is_better);
  };

  std::vector<std::string> columns = {"rpc_sync identity", "ddprpc p50", "ddprpc p90",
                                      "PyTorch p50", "PyTorch p90", "p50 speedup", "raw TCP p50",
                                      absl::StrCat("raw TCP x", FLAGS_raw_tcp_streams),
                                      "ddprpc / raw TCP"};
  if (several) columns.push_back("speedup per round");
  bench::Table table(columns);
  auto fmt_us = [](double v) { return v > 0 ? absl::StrFormat("%.0f us", v) : std::string("-"); };
  auto ratio = [](const bench::RoundSpeedups& r) {
    return r.per_round.empty() ? std::string("-") : absl::StrFormat("%.2fx", r.median());
  };
  auto over_bound = [](double ours_us, double bound_us) {
    return ours_us > 0 && bound_us > 0 ? absl::StrFormat("%.2fx", ours_us / bound_us)
                                       : std::string("-");
  };
  std::map<std::string, bench::RoundSpeedups> speedups;  // by figure, for the JSON
  for (const auto& size : kSizes) {
    const std::string k = size.key;
    const double one = ours["tcp1_" + k + ".p50_us"];
    const double more = ours["tcpn_" + k + ".p50_us"];
    const double bound = more > 0 && more < one ? more : one;
    const bench::RoundSpeedups& r = speedups[k + ".p50_us"] =
        round_ratios(k + ".p50_us", /*higher_is_better=*/false);
    std::vector<std::string> cells = {
        size.label, fmt_us(ours[k + ".p50_us"]), fmt_us(ours[k + ".p90_us"]),
        fmt_us(theirs[k + ".p50_us"]), fmt_us(theirs[k + ".p90_us"]), ratio(r), fmt_us(one),
        fmt_us(more), over_bound(ours[k + ".p50_us"], bound)};
    if (several) cells.push_back(r.list());
    table.add(cells);
  }
  std::vector<std::string> rref = {"RRef method 16 B", fmt_us(ours["rref_method_16B.p50_us"]),
                                   fmt_us(ours["rref_method_16B.p90_us"]), "-", "-", "-", "-", "-",
                                   "-"};
  if (several) rref.push_back("");
  table.add(rref);
  const double our_tput = ours["async_16B_calls_per_s"];
  const double their_tput = theirs["async_16B_calls_per_s"];
  const bench::RoundSpeedups& tput = speedups["async_16B_calls_per_s"] =
      round_ratios("async_16B_calls_per_s", /*higher_is_better=*/true);
  std::vector<std::string> pipelined = {
      "rpc_async 16 B pipelined", absl::StrFormat("%.0f calls/s", our_tput), "",
      their_tput > 0 ? absl::StrFormat("%.0f calls/s", their_tput) : "-", "", ratio(tput), "",
      "", ""};
  if (several) pipelined.push_back(tput.list());
  table.add(pipelined);
  std::printf("\nrpc_pingpong: 2 workers, %s; %s; %d callee threads, %d CPUs, %s\n",
              where.c_str(),
              network_path()
                  ? (FLAGS_bulk_min_bytes > 0
                         ? "network paths (ddprpc: gRPC, tensors from --bulk_min_bytes on its bulk "
                           "path; PyTorch: TensorPipe uv + basic)"
                         : "network paths (ddprpc: gRPC only; PyTorch: TensorPipe uv + basic)")
                  : "each side's fastest path",
              FLAGS_num_worker_threads, bench::cpu_count(), bench::allocator_name().c_str());
  std::printf("%s\n", bench::versions().c_str());
  std::printf("%s", table.str().c_str());
  std::printf("raw TCP: plain sockets between the two ddprpc workers, each message written whole "
              "and echoed once whole, each read spinning up to %d us first (--spin_us) as "
              "ddprpc's waits do; x%d: split between %d connections, a thread each; "
              "ddprpc / raw TCP: against the faster of the two\n",
              FLAGS_spin_us, FLAGS_raw_tcp_streams, FLAGS_raw_tcp_streams);
  if (several) {
    std::printf("%zu interleaved rounds (--pairs): each time is the median of the rounds' p50 "
                "(or p90, or calls/s), each speedup the median of the rounds' speedups\n",
                rounds.theirs.size());
  }
  if (!pytorch_note.empty()) std::printf("%s\n", pytorch_note.c_str());

  bench::Json json;
  json.begin_object();
  json.key("benchmark").value("rpc_pingpong");
  json.key("config").begin_object();
  json.key("iters").value(FLAGS_iters);
  json.key("big_iters").value(FLAGS_big_iters);
  json.key("huge_iters").value(FLAGS_huge_iters);
  json.key("raw_tcp_streams").value(FLAGS_raw_tcp_streams);
  json.key("async_calls").value(FLAGS_async_calls);
  json.key("pairs").value(FLAGS_pairs);
  json.key("network_path").value(network_path());
  json.key("placement").value(where);
  json.key("num_worker_threads").value(FLAGS_num_worker_threads);
  json.key("cpus").value(bench::cpu_count());
  json.key("allocator").value(bench::allocator_name());
  json.versions();
  json.end_object();
  for (const auto* side : {"ddprpc", "pytorch"}) {
    const auto& m = std::string(side) == "ddprpc" ? ours : theirs;
    json.key(side).begin_object();
    for (const auto& [k, v] : m) json.key(k).value(v);
    json.end_object();
  }
  // Each round's speedup of a figure, and their median.
  json.key("speedups").begin_object();
  for (const auto& [k, r] : speedups) {
    if (!r.per_round.empty()) json.key(k).value(r.json());
  }
  json.end_object();
  json.end_object();
  const std::string path = bench::output_path(FLAGS_json);
  if (json.write(path)) std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace

// After main's one-time set-up; also where ranks forked by run_roles start.
int rank_main(int argc, char** argv) {
  bench::parse_flags(&argc, &argv, "benchmarks/rpc_pingpong");
  if (network_path()) FLAGS_same_host_transport = false;
  if (FLAGS_pairs < 1) {
    std::fprintf(stderr, "rpc_pingpong: --pairs must be at least 1 (see --help)\n");
    return 2;
  }
  if (bench::env_rank() >= 0) return worker();
  return coordinator(argc, argv);
}

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "round-trip latency and pipelined throughput of ddprpc RPC vs PyTorch RPC, on loopback or\n"
      "  across network namespaces (--hosts), beside a plain TCP socket pair\n"
      "  usage: rpc_pingpong [flags]");
  return bench::run_main(argc, argv, &rank_main);
}
