// allreduce: Gloo allreduce bus bandwidth of ddp::ProcessGroup for 4 KiB ..
// 64 MiB float32 tensors over 2 and 4 local processes, next to
// torch.distributed (gloo) measured in the same run
// (benchmarks/reference/allreduce_gloo.py with --python).
// Bus bandwidth = bytes * 2(n-1)/n / time, the median of several calls.
// --pairs=N runs N interleaved rounds (ours, then torch.distributed's) per
// process count and prints the medians of the rounds' times and ratios.
//
//   ./bazelw run //benchmarks:allreduce
//   ./bazelw run //benchmarks:allreduce -- --hosts=4   # root: one network namespace each
//
// With --hosts, rank r of both sides runs on network namespace r % hosts
// (network_hosts.h), and ddprpc's same-host allreduce is off: Gloo over
// TCP on both sides. Beside them from 1 MiB up, the bound: the same ranks
// stream the bytes a ring allreduce moves (2(n-1)/n of the buffer each
// way) around a ring of plain TCP connections (raw_tcp.h).
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <arpa/inet.h>
#include <gflags/gflags.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "benchmarks/common.h"
#include "benchmarks/harness.h"
#include "benchmarks/network_hosts.h"
#include "benchmarks/raw_tcp.h"
#include "benchmarks/rounds.h"
#include "ddp/process_group.h"
#include "rpc/rendezvous/launch.h"

DEFINE_string(nprocs, "2,4", "comma-separated process counts");
DEFINE_string(json, "allreduce.json", "where to write the figures");
DEFINE_bool(pytorch, true, "also measure torch.distributed gloo (needs the Python of --python, with torch)");
DEFINE_int32(hosts, 0,
             "run the processes on this many network namespaces on a bridge, rank r on r % hosts "
             "(needs root; ddprpc's same-host allreduce off); 0: all on this host's loopback");
DEFINE_bool(raw_tcp, true,
            "with the same-host allreduce off (--hosts), also time the bytes a ring allreduce "
            "moves over a ring of plain TCP connections between the same ranks (the bound), "
            "from 1 MiB up");
DEFINE_int32(pairs, 1,
             "rounds of interleaved runs per process count: ddprpc's processes, then "
             "torch.distributed's; each time printed is the median of the rounds', each ratio the "
             "median of the rounds' ratios, so that the machine's drift falls on both sides alike");
DECLARE_bool(same_host_allreduce);  // benchmarks/common.cc

namespace bench = ddprpc::benchmarks;
namespace ddp = ddprpc::ddp;

namespace {

constexpr int64_t kSizes[] = {4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20,
                              64 << 20};

constexpr int64_t kRawMinBytes = 1 << 20;

// Timed calls per size (the reference script takes as many): at least 9,
// so that the median of the largest sizes is not one call's.
int iters_for(int64_t bytes) {
  return static_cast<int>(std::max<int64_t>(9, std::min<int64_t>(200, (256 << 20) / bytes)));
}

// Joins this rank to a ring of plain TCP connections (rank r to r + 1),
// the addresses exchanged through `pg`.
absl::Status join_raw_ring(ddp::ProcessGroup& pg, const std::string& address,
                           bench::RawTcpRing* ring) {
  bench::RawTcpListener listener;
  absl::Status s = bench::raw_tcp_listen(address, &listener);
  if (!s.ok()) return s;
  in_addr ip{};
  ::inet_pton(AF_INET, address.c_str(), &ip);
  at::Tensor mine = at::empty({2}, at::kLong);
  mine[0] = static_cast<int64_t>(ntohl(ip.s_addr));
  mine[1] = static_cast<int64_t>(listener.port);
  std::vector<at::Tensor> all;
  for (int r = 0; r < pg.size(); ++r) all.push_back(at::empty({2}, at::kLong));
  pg.allgather(all, mine)->wait();
  const at::Tensor& next = all[(pg.rank() + 1) % pg.size()];
  in_addr next_ip{htonl(static_cast<uint32_t>(next[0].item<int64_t>()))};
  char host[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &next_ip, host, sizeof(host));
  return bench::raw_tcp_ring_connect(listener, host, static_cast<int>(next[1].item<int64_t>()),
                                     ring);
}

int worker() {
  ddp::ProcessGroupOptions options = bench::group_options();
  const char* master = std::getenv("MASTER_ADDR");
  options.listen_address = bench::local_address_towards(master ? master : "127.0.0.1");
  auto pg = ddp::init_process_group("gloo", "env://", -1, -1, options);
  const int n = pg->size();
  bench::RawTcpRing ring;
  if (FLAGS_raw_tcp && !FLAGS_same_host_allreduce && n > 1) {
    const absl::Status joined = join_raw_ring(*pg, options.listen_address, &ring);
    if (!joined.ok()) {
      std::fprintf(stderr, "allreduce: rank %d: no raw TCP ring: %s\n", pg->rank(),
                   joined.ToString().c_str());
      return 1;
    }
  }
  // Rank 0 hands back [bytes, median seconds, bus GB/s, raw ring median
  // seconds (0: not timed)] per size.
  bench::JsonValue out;
  auto* rows = out.mutable_list_value();
  for (int64_t bytes : kSizes) {
    at::Tensor t = at::ones({bytes / 4});
    for (int i = 0; i < 3; ++i) pg->allreduce({t})->wait();
    std::vector<double> times;
    for (int i = 0; i < iters_for(bytes); ++i) {
      pg->barrier()->wait();
      absl::Time start = absl::Now();
      pg->allreduce({t})->wait();
      times.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    }
    double med = bench::percentile(times, 0.5);
    double raw = 0;
    if (ring.to_next >= 0 && bytes >= kRawMinBytes) {
      // What each rank of a ring allreduce sends and receives.
      const std::string out(static_cast<size_t>(bytes * 2 * (n - 1) / n), '\1');
      std::string in;
      std::vector<double> raw_times;
      for (int i = 0; i < iters_for(bytes) + 2; ++i) {
        pg->barrier()->wait();
        absl::Time start = absl::Now();
        const absl::Status s = bench::raw_tcp_ring_round(ring, out, &in);
        if (!s.ok()) {
          std::fprintf(stderr, "allreduce: rank %d: raw TCP ring: %s\n", pg->rank(),
                       s.ToString().c_str());
          return 1;
        }
        if (i >= 2) raw_times.push_back(absl::ToDoubleSeconds(absl::Now() - start));
      }
      raw = bench::percentile(raw_times, 0.5);
    }
    auto* row = rows->add_values()->mutable_list_value();
    for (double v : {static_cast<double>(bytes), med, bytes * 2.0 * (n - 1) / n / med / 1e9, raw}) {
      row->add_values()->set_number_value(v);
    }
  }
  bench::raw_tcp_ring_close(&ring);
  std::string error;
  if (pg->rank() == 0 && !bench::write_result(out, &error)) {
    std::fprintf(stderr, "allreduce: cannot hand the results back: %s\n", error.c_str());
    return 1;
  }
  return 0;
}

// bytes -> (median seconds, bus GB/s)
using Results = std::map<int64_t, std::pair<double, double>>;

// One run's figures: by size, ours or torch.distributed's, and (ours only)
// the raw TCP ring's median seconds where timed.
struct Figures {
  Results times;
  std::map<int64_t, double> raw;
};

// Ours, and the raw TCP ring's median seconds by size (where timed).
Figures read_ours(const bench::JsonValue& result) {
  Figures f;
  for (const auto& row : result.list_value().values()) {
    const auto& v = row.list_value().values();
    if (v.size() == 4) {
      const auto bytes = static_cast<int64_t>(v[0].number_value());
      f.times[bytes] = {v[1].number_value(), v[2].number_value()};
      if (v[3].number_value() > 0) f.raw[bytes] = v[3].number_value();
    }
  }
  return f;
}

// The reference script's report: {"<bytes>": {"median_s": m, "busbw_gbps": b}, ...}.
Figures read_reference(const bench::JsonValue& report) {
  Figures f;
  if (!report.has_struct_value()) return f;
  for (const auto& [key, v] : report.struct_value().fields()) {
    int64_t bytes = 0;
    if (!absl::SimpleAtoi(key, &bytes)) continue;
    f.times[bytes] = {bench::json_number(v, {"median_s"}, 0),
                      bench::json_number(v, {"busbw_gbps"}, 0)};
  }
  return f;
}

double seconds(const Figures& f, int64_t bytes) {
  const auto it = f.times.find(bytes);
  return it == f.times.end() ? 0 : it->second.first;
}

std::string human(int64_t bytes) {
  if (bytes >= (1 << 20)) return absl::StrCat(bytes >> 20, " MiB");
  return absl::StrCat(bytes >> 10, " KiB");
}

int coordinator(int argc, char** argv) {
  const std::unique_ptr<bench::NetworkHosts> hosts = bench::hosts_from_flag("allreduce", FLAGS_hosts);
  const std::string where = hosts ? hosts->describe() : "this host's loopback";
  bench::Json json;
  json.begin_object();
  json.versions();
  json.key("placement").value(where);
  json.key("pairs").value(FLAGS_pairs);
  std::printf("%s\n", bench::versions().c_str());
  std::printf("processes on %s\n", where.c_str());
  for (const std::string& nstr : std::vector<std::string>(absl::StrSplit(FLAGS_nprocs, ','))) {
    const int n = std::stoi(nstr);
    bench::RolesOptions launch;
    launch.nprocs = n;
    launch.timeout = absl::Minutes(10);
    if (hosts) hosts->place(&launch);
    const std::string script = bench::source_path("benchmarks/reference/allreduce_gloo.py");
    bench::RoundsPlan plan;
    plan.name = absl::StrCat("allreduce, ", n, " processes");
    plan.rounds = FLAGS_pairs;
    plan.variants = {"ddprpc"};
    plan.with_theirs = FLAGS_pytorch && !script.empty();
    bench::Rounds<Figures> rounds;
    const int rc = bench::run_rounds<Figures>(
        plan,
        [&](const std::string&, int, Figures* ours) {
          std::fprintf(stderr, "allreduce: ddprpc ProcessGroupGloo, %d processes\n", n);
          const bench::RolesResult r = bench::run_roles(argc, argv, launch);
          if (!r.ok()) {
            std::fprintf(stderr, "allreduce: %s\n",
                         r.exit_code != 0 ? r.message.c_str() : r.result_error.c_str());
            return 1;
          }
          *ours = read_ours(r.result);
          return 0;
        },
        [&](int, Figures* theirs) {
          std::fprintf(stderr, "allreduce: torch.distributed gloo, %d processes\n", n);
          bench::ReferenceRun run;
          if (hosts) {
            bench::RolesOptions ranks = launch;
            ranks.master_port = 0;
            ranks.env.emplace_back("GLOO_SOCKET_IFNAME", "eth0");
            run = bench::run_reference_ranks(script, {"--nprocs", absl::StrCat(n)}, ranks);
          } else {
            run = bench::run_reference(script, {"--nprocs", absl::StrCat(n), "--port",
                                                absl::StrCat(ddprpc::rpc::pick_free_port())});
          }
          *theirs = read_reference(run.report);
          if (run.ok() && !theirs->times.empty()) return true;
          std::fprintf(stderr, "allreduce: torch.distributed gloo failed: %s\n",
                       run.failure().c_str());
          return false;
        },
        &rounds);
    if (rc != 0) return rc;
    const std::vector<Figures>& ours = rounds.ours["ddprpc"];
    const bool several = rounds.theirs.size() > 1;
    bool any_raw = false;
    for (const Figures& f : ours) any_raw = any_raw || !f.raw.empty();
    std::vector<std::string> columns = {absl::StrCat("allreduce, ", n, " processes"),
                                        "ddprpc", "busbw", "torch.distributed", "busbw", "ratio"};
    if (any_raw) {
      columns.push_back("raw TCP ring");
      columns.push_back("ddprpc / raw");
    }
    if (several) columns.push_back("ratio per round");
    bench::Table table(columns);
    json.key(absl::StrCat("nprocs_", n)).begin_object();
    for (int64_t bytes : kSizes) {
      auto busbw = [&](double s) { return s > 0 ? bytes * 2.0 * (n - 1) / n / s / 1e9 : 0; };
      auto seconds_of = [&](const Figures& f) { return seconds(f, bytes); };
      const double m = bench::median_over<Figures>(ours, seconds_of);
      const double tm = bench::median_over<Figures>(rounds.theirs, seconds_of);
      const double rm = bench::median_over<Figures>(ours, [&](const Figures& f) {
        const auto it = f.raw.find(bytes);
        return it == f.raw.end() ? 0 : it->second;
      });
      const bench::RoundSpeedups ratios = rounds.speedups(
          "ddprpc", [&](const Figures& f) { return seconds(f, bytes); },
          /*higher_is_better=*/false);
      std::vector<std::string> cells = {
          human(bytes), absl::StrFormat("%.1f us", m * 1e6),
          absl::StrFormat("%.3f GB/s", busbw(m)),
          tm > 0 ? absl::StrFormat("%.1f us", tm * 1e6) : "-",
          tm > 0 ? absl::StrFormat("%.3f GB/s", busbw(tm)) : "-",
          ratios.per_round.empty() ? "-" : absl::StrFormat("%.2fx", ratios.median())};
      if (any_raw) {
        cells.push_back(rm > 0 ? absl::StrFormat("%.1f us", rm * 1e6) : "-");
        cells.push_back(rm > 0 ? absl::StrFormat("%.2fx", m / rm) : "-");
      }
      if (several) cells.push_back(ratios.list());
      table.add(cells);
      json.key(absl::StrCat(bytes)).begin_object();
      json.key("ddprpc_busbw_gbps").value(busbw(m)).key("ddprpc_median_s").value(m);
      json.key("pytorch_busbw_gbps").value(busbw(tm)).key("pytorch_median_s").value(tm);
      if (rm > 0) json.key("raw_tcp_ring_median_s").value(rm);
      if (!ratios.per_round.empty()) json.key("ratio").value(ratios.json());
      json.end_object();
    }
    json.end_object();
    std::printf("%s", table.str().c_str());
    if (several) {
      std::printf("%zu interleaved rounds (--pairs): each time is the median of the rounds' "
                  "medians, each ratio the median of the rounds' ratios\n",
                  rounds.theirs.size());
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  json.end_object();
  const std::string path = bench::output_path(FLAGS_json);
  if (json.write(path)) std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace

// After main's one-time set-up; also where ranks forked by run_roles start.
int rank_main(int argc, char** argv) {
  bench::parse_flags(&argc, &argv, "benchmarks/allreduce");
  if (FLAGS_hosts > 0) FLAGS_same_host_allreduce = false;
  if (FLAGS_pairs < 1) {
    std::fprintf(stderr, "allreduce: --pairs must be at least 1 (see --help)\n");
    return 2;
  }
  if (bench::env_rank() >= 0) return worker();
  return coordinator(argc, argv);
}

int main(int argc, char** argv) {
  gflags::SetUsageMessage("Gloo allreduce bus bandwidth: ddprpc vs torch.distributed");
  return bench::run_main(argc, argv, &rank_main);
}
