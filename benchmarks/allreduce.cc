// allreduce: Gloo allreduce bus bandwidth of ddp::ProcessGroup for 4 KiB ..
// 64 MiB float32 tensors over 2 and 4 local processes, next to
// torch.distributed (gloo) measured in the same run
// (benchmarks/reference/allreduce_gloo.py with /usr/bin/python3).
// Bus bandwidth = bytes * 2(n-1)/n / time, the median of several calls.
//
//   ./bazelw run //benchmarks:allreduce
#include <ATen/ops/ones.h>
#include <gflags/gflags.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "benchmarks/common.h"
#include "ddp/process_group.h"
#include "rpc/launch.h"

DEFINE_string(nprocs, "2,4", "comma-separated process counts");
DEFINE_string(json, "allreduce.json", "where to write the figures");
DEFINE_bool(pytorch, true, "also measure torch.distributed gloo (needs /usr/bin/python3 with torch)");
DEFINE_string(result_file, "", "internal: where rank 0 writes its results");

namespace bench = ddprpc::benchmarks;
namespace ddp = ddprpc::ddp;

namespace {

constexpr int64_t kSizes[] = {4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20,
                              64 << 20};

int iters_for(int64_t bytes) {
  return static_cast<int>(std::max<int64_t>(5, std::min<int64_t>(200, (256 << 20) / bytes)));
}

int worker() {
  auto pg = ddp::init_process_group("gloo");
  const int n = pg->size();
  std::ostringstream out;
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
    out << bytes << " " << med << " " << bytes * 2.0 * (n - 1) / n / med / 1e9 << "\n";
  }
  if (pg->rank() == 0) std::ofstream(FLAGS_result_file) << out.str();
  return 0;
}

// bytes -> (median seconds, bus GB/s)
using Results = std::map<int64_t, std::pair<double, double>>;

Results read_ours(const std::string& path) {
  Results r;
  std::ifstream in(path);
  int64_t bytes;
  double med, bw;
  while (in >> bytes >> med >> bw) r[bytes] = {med, bw};
  return r;
}

Results parse_reference(const std::string& json) {
  Results r;
  std::regex re("\"([0-9]+)\"\\s*:\\s*\\{\\s*\"median_s\"\\s*:\\s*([0-9.eE+-]+)\\s*,\\s*\"busbw_gbps\"\\s*:\\s*([0-9.eE+-]+)");
  for (std::sregex_iterator it(json.begin(), json.end(), re), end; it != end; ++it) {
    r[std::stoll((*it)[1].str())] = {std::stod((*it)[2].str()), std::stod((*it)[3].str())};
  }
  return r;
}

std::string human(int64_t bytes) {
  if (bytes >= (1 << 20)) return absl::StrCat(bytes >> 20, " MiB");
  return absl::StrCat(bytes >> 10, " KiB");
}

int coordinator(int argc, char** argv) {
  bench::Json json;
  json.begin_object();
  for (const std::string& nstr : std::vector<std::string>(absl::StrSplit(FLAGS_nprocs, ','))) {
    const int n = std::stoi(nstr);
    const std::string tmp = bench::temp_path(absl::StrCat("allreduce", n));
    auto launch = bench::relaunch_self(n, argc, argv);
    launch.argv.push_back("--result_file=" + tmp);
    launch.timeout = absl::Minutes(10);
    std::fprintf(stderr, "allreduce: ddprpc ProcessGroupGloo, %d processes\n", n);
    if (ddprpc::rpc::launch(launch).exit_code != 0) return 1;
    Results ours = read_ours(tmp);
    std::remove(tmp.c_str());
    Results theirs;
    const std::string script = bench::source_path("benchmarks/reference/allreduce_gloo.py");
    if (FLAGS_pytorch && !script.empty()) {
      std::fprintf(stderr, "allreduce: torch.distributed gloo, %d processes\n", n);
      const std::string out = tmp + ".json";
      std::string log;
      bench::run_command({"/usr/bin/python3", script, "--nprocs", absl::StrCat(n), "--port",
                          absl::StrCat(ddprpc::rpc::pick_free_port()), "--json", out},
                         &log);
      std::ifstream in(out);
      std::stringstream s;
      s << in.rdbuf();
      theirs = parse_reference(s.str());
      std::remove(out.c_str());
    }
    bench::Table table({absl::StrCat("allreduce, ", n, " processes"), "ddprpc", "busbw",
                        "torch.distributed", "busbw", "ratio"});
    json.key(absl::StrCat("nprocs_", n)).begin_object();
    for (int64_t bytes : kSizes) {
      auto [m, bw] = ours[bytes];
      auto [tm, tbw] = theirs.count(bytes) ? theirs[bytes] : std::pair<double, double>{0, 0};
      table.add({human(bytes), absl::StrFormat("%.1f us", m * 1e6), absl::StrFormat("%.3f GB/s", bw),
                 tm > 0 ? absl::StrFormat("%.1f us", tm * 1e6) : "-",
                 tm > 0 ? absl::StrFormat("%.3f GB/s", tbw) : "-",
                 tm > 0 ? absl::StrFormat("%.2fx", tm / m) : "-"});
      json.key(absl::StrCat(bytes)).begin_object();
      json.key("ddprpc_busbw_gbps").value(bw).key("ddprpc_median_s").value(m);
      json.key("pytorch_busbw_gbps").value(tbw).key("pytorch_median_s").value(tm);
      json.end_object();
    }
    json.end_object();
    std::printf("%s\n", table.str().c_str());
    std::fflush(stdout);
  }
  json.end_object();
  const std::string path = bench::output_path(FLAGS_json);
  if (json.write(path)) std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage("Gloo allreduce bus bandwidth: ddprpc vs torch.distributed");
  bench::parse_flags(&argc, &argv, "benchmarks/allreduce");
  if (bench::env_rank() >= 0) return worker();
  return coordinator(argc, argv);
}
