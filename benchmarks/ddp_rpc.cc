// ddp_rpc: the DDP + RPC hybrid benchmark (../shared/seeds/ddp-rpc-hybrid-benchmark.txt),
// with PyTorch's own stack measured in the same run (../shared/anchors/ref_ddp_rpc.py).
//
//   ./bazelw run //benchmarks:ddp_rpc -- --trainers=8 --ps=8
//
// Processes: trainers 0..T-1, parameter servers T..T+P-1, master T+P. The
// master creates an EmbeddingBag table on every PS (rpc::remote) and starts
// training on every trainer by RPC. Each trainer builds a HybridModel (the
// tables by RRef + a dense stack averaged across trainers by DDP), and per
// iteration trains on 10 random batches, each in a dist_autograd context:
// forward, CrossEntropy, dist_autograd::backward, DistributedOptimizer(SGD,
// lr=0.05).step. The master prints p50/p75/p90/p95 sec/iter and ex/sec per
// trainer and for All (per iteration: the slowest trainer's time, the sum
// of examples), and writes every figure to --json.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randint.h>
#include <gflags/gflags.h>
#include <grpcpp/grpcpp.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <regex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "autograd/dist_autograd.h"
#include "benchmarks/common.h"
#include "ddp/distributed_data_parallel.h"
#include "rpc/store.h"
#include "models/hybrid_model.h"
#include "optim/distributed_optimizer.h"
#include "rpc/launch.h"
#include "rpc/rref.h"

DEFINE_int32(trainers, 8, "number of trainer processes (DDP replicas)");
DEFINE_int32(ps, 8, "number of parameter servers (one embedding table each)");
DEFINE_int32(num_embeddings, 300, "rows of each embedding table");
DEFINE_int32(embedding_dim, 64, "columns of each embedding table (fc_in = ps * embedding_dim)");
DEFINE_int32(iters, 20, "measured iterations per trainer (each = 10 batches)");
DEFINE_int32(warmup, 2, "iterations per trainer before measuring");
DEFINE_string(backend, "gloo",
              "DDP collective backend among trainers: gloo (CPU) or nccl (GPU; needs a CUDA build "
              "and a visible GPU)");
DEFINE_int32(num_worker_threads, 16, "RPC worker threads per process");
DEFINE_string(json, "ddp_rpc.json",
              "where to write every figure and the configuration (relative to the directory "
              "bazel run started in)");
DEFINE_bool(pytorch, true,
            "also run PyTorch's reference (../shared/anchors/ref_ddp_rpc.py, /usr/bin/python3) "
            "with the same configuration and print the ratio");
DEFINE_string(pytorch_anchor, "", "path of the PyTorch reference script (default: found in ../shared)");
DEFINE_int32(timeout_s, 1800, "stop everything after this many seconds");
DEFINE_string(result_file, "", "internal: where the master writes its results");

namespace rpc = ddprpc::rpc;
namespace bench = ddprpc::benchmarks;
namespace models = ddprpc::models;
namespace dist_autograd = ddprpc::dist_autograd;

namespace {

struct Role {
  int trainers, ps, rank;
  bool is_trainer() const { return rank < trainers; }
  bool is_ps() const { return rank >= trainers && rank < trainers + ps; }
  bool is_master() const { return rank == trainers + ps; }
  std::string name() const {
    if (is_trainer()) return absl::StrCat("trainer", rank);
    if (is_ps()) return absl::StrCat("ps", rank - trainers);
    return "master";
  }
};

struct Batch {
  at::Tensor indices, offsets, targets;
};

// 10 batches: 20..50 random indices, offsets with random steps 1..10,
// random targets in [0, 8).
std::vector<Batch> make_batches(std::mt19937& rng, int64_t num_embeddings) {
  std::vector<Batch> out;
  for (int b = 0; b < 10; ++b) {
    const int64_t k = std::uniform_int_distribution<int64_t>(20, 50)(rng);
    std::vector<int64_t> offsets;
    for (int64_t s = 0; s < k; s += std::uniform_int_distribution<int64_t>(1, 10)(rng)) {
      offsets.push_back(s);
    }
    const int64_t n = static_cast<int64_t>(offsets.size());
    out.push_back({at::randint(0, num_embeddings, {k}, at::kLong),
                   at::tensor(offsets, at::kLong), at::randint(0, 8, {n}, at::kLong)});
  }
  return out;
}

// Runs on each trainer, started by the master. Returns seconds and examples
// per measured iteration, and the mean milliseconds per batch spent in
// forward, backward, optimizer step and context release.
std::tuple<std::vector<double>, std::vector<int64_t>, std::vector<double>> run_trainer(
    std::vector<rpc::RRef<models::EmbeddingTable>> tables, int64_t rank, int64_t iters,
    int64_t warmup, int64_t num_embeddings, int64_t embedding_dim) {
  std::mt19937 rng(static_cast<uint32_t>(rank));
  at::manual_seed(rank);
  models::HybridModel model(std::move(tables), embedding_dim);
  // DDP among the trainers (rendezvous through the RPC store): the same
  // initial dense parameters everywhere, gradients averaged inside every
  // dist_autograd backward pass.
  const std::string address = rpc::current_agent()->store().address();
  const size_t colon = address.rfind(':');
  auto store = std::make_shared<rpc::Store>(address.substr(0, colon),
                                            std::stoi(address.substr(colon + 1)),
                                            absl::Seconds(FLAGS_timeout_s));
  auto group = FLAGS_backend == "nccl"
                   ? ddprpc::ddp::make_nccl_group(store, "ddp/trainers/", static_cast<int>(rank),
                                                  FLAGS_trainers)
                   : ddprpc::ddp::make_gloo_group(store, "ddp/trainers/", static_cast<int>(rank),
                                                  FLAGS_trainers);
  ddprpc::ddp::DistributedDataParallel ddp(model.dense().ptr(), group);
  ddprpc::optim::DistributedOptimizer optimizer("sgd", {{"lr", 0.05}}, model.parameter_rrefs());
  std::vector<double> seconds;
  std::vector<int64_t> examples;
  std::vector<double> phase_ms(4, 0.0);  // forward, backward, step, release
  int64_t measured_batches = 0;
  for (int64_t it = 0; it < iters + warmup; ++it) {
    absl::Time start = absl::Now();
    int64_t n = 0;
    for (const Batch& b : make_batches(rng, num_embeddings)) {
      n += b.targets.size(0);
      absl::Time t[5];
      {
        t[0] = absl::Now();
        dist_autograd::Context context;
        at::Tensor loss = at::cross_entropy_loss(model.forward(b.indices, b.offsets), b.targets);
        t[1] = absl::Now();
        dist_autograd::backward(context.id(), {loss});
        t[2] = absl::Now();
        optimizer.step(context.id());
        t[3] = absl::Now();
      }
      t[4] = absl::Now();
      if (it >= warmup) {
        for (int i = 0; i < 4; ++i) phase_ms[i] += absl::ToDoubleMilliseconds(t[i + 1] - t[i]);
        ++measured_batches;
      }
    }
    if (it >= warmup) {
      seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
      examples.push_back(n);
    }
    if (rank == 0) {
      std::fprintf(stderr, "ddp_rpc: trainer0 iteration %lld/%lld (%s)\n",
                   static_cast<long long>(it + 1), static_cast<long long>(iters + warmup),
                   it < warmup ? "warm-up" : "measured");
    }
  }
  for (double& ms : phase_ms) ms /= std::max<int64_t>(1, measured_batches);
  return {seconds, examples, phase_ms};
}
DDPRPC_REGISTER_FUNCTION(run_trainer);

struct Percentiles {
  double sec[4], ex[4];
};
constexpr int kPcts[] = {50, 75, 90, 95};

// As the reference: sec/iter at p, ex/sec at (100 - p) of examples/seconds.
Percentiles percentiles(const std::vector<double>& seconds, const std::vector<double>& examples) {
  Percentiles p{};
  std::vector<double> rate;
  for (size_t i = 0; i < seconds.size(); ++i) rate.push_back(examples[i] / seconds[i]);
  for (int i = 0; i < 4; ++i) {
    p.sec[i] = bench::percentile(seconds, kPcts[i] / 100.0);
    p.ex[i] = bench::percentile(rate, (100 - kPcts[i]) / 100.0);
  }
  return p;
}

std::string pct_line(const std::string& name, const Percentiles& p) {
  std::string line = absl::StrFormat("%9s:", name);
  for (int i = 0; i < 4; ++i) {
    absl::StrAppendFormat(&line, "  p%d: %.3fs %6.0f/s", kPcts[i], p.sec[i], p.ex[i]);
  }
  return line;
}

void json_percentiles(bench::Json& json, const Percentiles& p) {
  json.begin_object();
  for (int i = 0; i < 4; ++i) {
    json.key(absl::StrCat("p", kPcts[i])).begin_object();
    json.key("sec_per_iter").value(p.sec[i]).key("ex_per_sec").value(p.ex[i]);
    json.end_object();
  }
  json.end_object();
}

int master(const Role& role) {
  absl::Time start = absl::Now();
  std::vector<rpc::RRef<models::EmbeddingTable>> tables;
  for (int i = 0; i < role.ps; ++i) {
    tables.push_back(rpc::remote<models::EmbeddingTable>(absl::StrCat("ps", i),
                                                          int64_t{FLAGS_num_embeddings},
                                                          int64_t{FLAGS_embedding_dim}));
  }
  using Result = std::tuple<std::vector<double>, std::vector<int64_t>, std::vector<double>>;
  std::vector<rpc::Future<Result>> runs;
  for (int r = 0; r < role.trainers; ++r) {
    runs.push_back(rpc::rpc_async<Result>(rpc::CallOptions{absl::Seconds(FLAGS_timeout_s)},
                                          absl::StrCat("trainer", r), "run_trainer", tables,
                                          int64_t{r}, int64_t{FLAGS_iters}, int64_t{FLAGS_warmup},
                                          int64_t{FLAGS_num_embeddings},
                                          int64_t{FLAGS_embedding_dim}));
  }
  rpc::collect_all(runs).wait();
  std::vector<Result> results;
  bool failed = false;
  for (int r = 0; r < role.trainers; ++r) {
    if (runs[r].has_error()) {
      // Every failure: the first one in rank order may only be a symptom
      // (e.g. an allreduce broken because another trainer stopped).
      std::fprintf(stderr, "ddp_rpc: training failed on trainer%d: %s\n", r,
                   runs[r].error_message().c_str());
      failed = true;
    } else {
      results.push_back(runs[r].value());
    }
  }
  if (failed) return 1;
  const double wall = absl::ToDoubleSeconds(absl::Now() - start);

  std::ostringstream out;
  out << "------------------ ddprpc Distributed Benchmark (DDP and RPC) ---------------------\n";
  out << "                sec/iter    ex/sec      sec/iter    ex/sec      sec/iter    ex/sec      "
         "sec/iter    ex/sec\n";
  bench::Json json;
  json.begin_object();
  std::vector<double> all_sec(FLAGS_iters, 0.0), all_ex(FLAGS_iters, 0.0);
  std::vector<double> phases(4, 0.0);
  for (int r = 0; r < role.trainers; ++r) {
    const auto& [sec, ex, phase_ms] = results[r];
    for (int i = 0; i < 4; ++i) phases[i] += phase_ms[i] / role.trainers;
    std::vector<double> exd(ex.begin(), ex.end());
    Percentiles p = percentiles(sec, exd);
    out << pct_line(absl::StrCat("Trainer", r), p) << "\n";
    json.key(absl::StrCat("trainer", r));
    json_percentiles(json, p);
    for (size_t i = 0; i < sec.size() && i < all_sec.size(); ++i) {
      all_sec[i] = std::max(all_sec[i], sec[i]);
      all_ex[i] += exd[i];
    }
  }
  Percentiles all = percentiles(all_sec, all_ex);
  out << pct_line("All", all) << "\n";
  json.key("all");
  json_percentiles(json, all);
  json.key("wall_s").value(wall);
  static const char* kPhases[] = {"forward", "backward", "optimizer_step", "context_release"};
  out << absl::StrFormat("Where a batch goes (mean over trainers, ms): ");
  json.key("ms_per_batch").begin_object();
  for (int i = 0; i < 4; ++i) {
    out << absl::StrFormat("%s %.2f%s", kPhases[i], phases[i], i < 3 ? ", " : "\n");
    json.key(kPhases[i]).value(phases[i]);
  }
  json.end_object();
  json.end_object();
  std::ofstream(FLAGS_result_file + ".txt") << out.str();
  std::ofstream(FLAGS_result_file) << json.str() << "\n";
  return 0;
}

int worker(const Role& role) {
  at::set_num_threads(1);  // as the reference: many processes share the cores
  rpc::RpcBackendOptions options;
  options.num_worker_threads = FLAGS_num_worker_threads;
  options.rpc_timeout = absl::Seconds(FLAGS_timeout_s);
  rpc::init_rpc(role.name(), role.rank, role.trainers + role.ps + 1, options);
  int rc = role.is_master() ? master(role) : 0;
  rpc::shutdown(/*graceful=*/rc == 0);
  return rc;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// "All" p50 sec/iter of a results JSON ({"all": {"p50": {"sec_per_iter": x ...).
double all_p50(const std::string& json) {
  std::smatch m;
  std::regex re("\"all\"\\s*:\\s*\\{\\s*\"p50\"\\s*:\\s*\\{\\s*\"sec_per_iter\"\\s*:\\s*([0-9.eE+-]+)");
  return std::regex_search(json, m, re) ? std::stod(m[1].str()) : 0;
}

std::string trim_json(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s.empty() ? "null" : s;
}

int coordinator(int argc, char** argv) {
  const int world = FLAGS_trainers + FLAGS_ps + 1;
  std::printf("---------- Info ---------\n");
  std::printf("* ddprpc: libtorch %d.%d.%d, gRPC %s, collectives: %s\n", TORCH_VERSION_MAJOR,
              TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, grpc::Version().c_str(),
              FLAGS_backend == "nccl" ? "NCCL" : "Gloo");
  std::printf("* CPUs: %d; processes: %d trainers + %d parameter servers + 1 master\n",
              bench::cpu_count(), FLAGS_trainers, FLAGS_ps);
  std::printf("* embedding tables: %d x %d each, fc_in = %d; %d measured + %d warm-up iterations\n",
              FLAGS_num_embeddings, FLAGS_embedding_dim, FLAGS_ps * FLAGS_embedding_dim, FLAGS_iters,
              FLAGS_warmup);
  std::string topo;
  if (bench::run_command({"nvidia-smi", "topo", "-m"}, &topo) == 0) {
    std::printf("---------- nvidia-smi topo -m ---------\n%s", topo.c_str());
  }
  std::fflush(stdout);

  const std::string tmp = bench::temp_path("ddp_rpc");
  auto launch = bench::relaunch_self(world, argc, argv);
  launch.argv.push_back("--result_file=" + tmp);
  launch.timeout = absl::Seconds(FLAGS_timeout_s);
  launch.grace_period = absl::Seconds(20);  // let the master report which call failed
  std::fprintf(stderr, "ddp_rpc: starting %d processes\n", world);
  rpc::LaunchResult r = rpc::launch(launch);
  if (r.exit_code != 0) {
    std::string who = r.failed_rank < 0 ? "" : Role{FLAGS_trainers, FLAGS_ps, r.failed_rank}.name();
    std::fprintf(stderr, "ddp_rpc: failed: %s%s\n", who.empty() ? "" : (who + ": ").c_str(),
                 r.message.c_str());
    return 1;
  }
  const std::string ours = read_file(tmp);
  std::printf("%s", read_file(tmp + ".txt").c_str());
  std::remove(tmp.c_str());
  std::remove((tmp + ".txt").c_str());

  std::string theirs;
  const std::string anchor = FLAGS_pytorch_anchor.empty()
                                 ? bench::shared_path("anchors/ref_ddp_rpc.py")
                                 : FLAGS_pytorch_anchor;
  if (FLAGS_pytorch && !anchor.empty()) {
    std::fprintf(stderr, "ddp_rpc: running PyTorch's reference (%s), same configuration\n",
                 anchor.c_str());
    const std::string json = tmp + ".pytorch.json";
    std::string output;
    int rc = bench::run_command(
        {"/usr/bin/python3", anchor, "--trainers", absl::StrCat(FLAGS_trainers), "--ps",
         absl::StrCat(FLAGS_ps), "--emb", absl::StrCat(FLAGS_num_embeddings), "--dim",
         absl::StrCat(FLAGS_embedding_dim), "--iters", absl::StrCat(FLAGS_iters), "--warmup",
         absl::StrCat(FLAGS_warmup), "--port", absl::StrCat(rpc::pick_free_port()), "--json", json},
        &output);
    theirs = read_file(json);
    std::remove(json.c_str());
    std::printf("------------------ PyTorch reference (same machine, same run) ---------------------\n");
    std::istringstream lines(output);
    for (std::string line; std::getline(lines, line);) {
      // Its table and summary, without its processes' log lines.
      if (line.find(": p50:") != std::string::npos || line.rfind("PyTorch", 0) == 0 ||
          line.rfind("wall", 0) == 0) {
        std::printf("%s\n", line.c_str());
      }
    }
    if (rc != 0) std::printf("PyTorch reference failed (exit %d)\n", rc);
  } else {
    std::printf("PyTorch reference not run (--pytorch=false or no anchor script found)\n");
  }
  const double ours_p50 = all_p50(ours), theirs_p50 = all_p50(theirs);
  if (ours_p50 > 0 && theirs_p50 > 0) {
    std::printf("All p50 sec/iter: ddprpc %.3fs, PyTorch %.3fs: ddprpc is %.2fx %s\n", ours_p50,
                theirs_p50, theirs_p50 >= ours_p50 ? theirs_p50 / ours_p50 : ours_p50 / theirs_p50,
                theirs_p50 >= ours_p50 ? "faster" : "slower");
  }
  bench::Json config;
  config.begin_object();
  config.key("trainers").value(FLAGS_trainers).key("ps").value(FLAGS_ps);
  config.key("num_embeddings").value(FLAGS_num_embeddings);
  config.key("embedding_dim").value(FLAGS_embedding_dim);
  config.key("iters").value(FLAGS_iters).key("warmup").value(FLAGS_warmup);
  config.key("backend").value(FLAGS_backend).key("cpus").value(bench::cpu_count());
  config.end_object();
  const std::string path = bench::output_path(FLAGS_json);
  std::ofstream(path) << "{\"config\":" << config.str() << ",\"ddprpc\":" << trim_json(ours)
                      << ",\"pytorch\":" << trim_json(theirs) << "}\n";
  std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "DDP + RPC hybrid benchmark (master + trainers + parameter servers), with PyTorch's own "
      "stack measured in the same run\n  usage: ddp_rpc [--trainers=8 --ps=8 ...]");
  bench::parse_flags(&argc, &argv, "benchmarks/ddp_rpc");
  if (FLAGS_backend != "gloo" && FLAGS_backend != "nccl") {
    std::fprintf(stderr, "ddp_rpc: --backend must be gloo or nccl\n");
    return 2;
  }
  if (FLAGS_backend == "nccl" && !ddprpc::ddp::nccl_available()) {
    std::fprintf(stderr, "ddp_rpc: --backend=nccl needs a CUDA build and a visible GPU\n");
    return 2;
  }
  if (FLAGS_trainers < 1 || FLAGS_ps < 1 || FLAGS_iters < 1) {
    std::fprintf(stderr, "ddp_rpc: --trainers, --ps and --iters must be at least 1\n");
    return 2;
  }
  if (bench::env_rank() >= 0) return worker(Role{FLAGS_trainers, FLAGS_ps, bench::env_rank()});
  return coordinator(argc, argv);
}
