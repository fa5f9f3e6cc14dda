// ddp_rpc: the DDP + RPC hybrid benchmark, with PyTorch's own stack measured
// in the same run (benchmarks/reference/ddp_rpc.py, in this binary's runfiles).
//
//   ./bazelw run //benchmarks:ddp_rpc -- --trainers=8 --ps=8
//
// Processes (ranks): trainers 0..T-1, parameter servers T..T+P-1, master
// T+P. Without a rank this binary starts all of them on this host; with
// --rank (or RANK, as torchrun sets it) it runs just that role, so that a
// launcher can start the ranks across hosts. The master creates an
// EmbeddingBag table on every PS (rpc::remote) and starts training on every
// trainer by RPC (models/hybrid_trainer.h). Each trainer builds a
// HybridModel (the tables by RRef + a dense stack averaged across trainers
// by DDP), and per iteration trains on
// --batches_per_iter random batches, each in a dist_autograd context:
// forward, CrossEntropy, dist_autograd::backward, DistributedOptimizer(SGD,
// --lr).step. The master prints p50/p75/p90/p95 sec/iter and ex/sec per
// trainer and for All (per iteration: the slowest trainer's time, the sum
// of examples), and writes every figure to --json. --check_convergence
// trains on a learnable target instead and checks that the loss falls and
// the tables on the parameter servers change.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <arpa/inet.h>
#include <gflags/gflags.h>
#include <gloo/config.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <sys/socket.h>
#include <torch/version.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "benchmarks/common.h"
#include "benchmarks/harness.h"
#include "benchmarks/network_hosts.h"
#include "benchmarks/rounds.h"
#include "ddp/process_group.h"
#include "models/hybrid_trainer.h"
#include "rpc/rendezvous/launch.h"
#include "rpc/rendezvous/launch_env.h"
#include "rpc/rpc.h"

#ifdef DDPRPC_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

// Workload.
DEFINE_int32(trainers, 8, "number of trainer processes (DDP replicas)");
DEFINE_int32(ps, 8, "number of parameter servers (one embedding table each)");
DEFINE_int32(num_embeddings, 300, "rows of each embedding table");
DEFINE_int32(embedding_dim, 64, "columns of each embedding table (fc_in = ps * embedding_dim)");
DEFINE_int32(iters, 100, "measured iterations per trainer");
DEFINE_int32(warmup, 5, "iterations per trainer before measuring (left out of every figure)");
DEFINE_int32(batches_per_iter, 10,
             "batches per iteration; each has 20..50 indices cut into bags of 1..10");
DEFINE_double(lr, 0.05, "learning rate of the DistributedOptimizer (SGD)");
DEFINE_uint64(seed, 1,
              "seed of the data and of the initial parameters; rank r draws from a stream "
              "derived from (seed, r), so a run is repeatable and the trainers' data differ");
DEFINE_bool(check_convergence, false,
            "train on a learnable target (every index of a bag has index % 8 == the bag's "
            "target) and exit with code 3 unless the mean loss of the last iteration is at "
            "least 10% below the first one's and every parameter server's table changed");
DEFINE_bool(elastic, false,
            "elastic training (docs/elastic.md): a trainer lost in the middle of the run is "
            "dropped, the survivors re-form their DDP group in the next membership epoch and "
            "train on; a parameter server lost has its shards restored on a surviving server "
            "from their last checkpoint, and the trainers re-bind to them; the table marks "
            "what was lost (and the updates lost) and the run still ends normally");
DEFINE_string(kill, "",
              "faults to inject, comma-separated or one --kill each, trainerN@iterK or "
              "psN@iterK: trainer N ends "
              "its process at once (as a crash) when it starts iteration K (0-based, warm-up "
              "included); parameter server N ends its own when the trainers' rank 0 starts "
              "iteration K (before that iteration's checkpoint); trainers need --elastic to "
              "train on, servers need it at all; leaves PyTorch's reference out");
DEFINE_string(add, "",
              "--elastic: standby trainers, comma-separated trainer@iterK: one more trainer "
              "process per entry (trainer<trainers + j>, started with the job, outside the "
              "membership) asks to join when the trainers' rank 0 starts iteration K, is "
              "admitted at the first iteration start after it asked, takes the dense stack "
              "from the trainers' rank 0 and trains on; the world size counts them");
DEFINE_int32(checkpoint_every, 10,
             "--elastic: checkpoint every embedding shard every N iterations (and once before "
             "the first); 0: only before the first");
DEFINE_bool(replicate_checkpoints, true,
            "--elastic: keep each shard's checkpoint in the memory of the next parameter server");
DEFINE_string(checkpoint_dir, "",
              "--elastic: parameter servers also write each shard's checkpoint under this "
              "directory, which every server must share (a subdirectory per run; a shard is "
              "restored from the newer of its replica and its file); empty: no files");
DEFINE_bool(sparse, false,
            "sparse (COO) embedding gradients: a backward pass sends each parameter server only "
            "the rows its batch looked up, and SGD updates only those (EmbeddingBag's "
            "sparse=True, on both sides); dense gradients cover the whole table");
DEFINE_string(lookups, "concurrent",
              "how a trainer's forward reaches the parameter servers: concurrent (rpc_async to "
              "every server, then wait for all) or sequential (rpc_sync one after another, the "
              "order of PyTorch's original benchmark); PyTorch's reference runs the same");
DEFINE_string(dense_kernel, "",
              "kernels of the dense layers, a comma list, one run of ddprpc each: xnnpack (ours) "
              "or aten (libtorch's Linear, the kernel PyTorch's side runs). Against PyTorch, "
              "aten gives the ratio of the runtimes alone and xnnpack the ratio of the product. "
              "Default: xnnpack,aten where libtorch has XNNPACK, else aten (PyTorch's x86 wheels "
              "have none). A rank started on its own uses the first");
DEFINE_string(backend, "gloo",
              "DDP collective backend among trainers: gloo (CPU) or nccl (GPU; needs a CUDA build "
              "and a visible GPU)");
DEFINE_int32(num_worker_threads, 16, "RPC worker threads per process");

// Where the processes run.
DEFINE_int32(rank, -1,
             "run only this role (trainers 0..T-1, parameter servers T..T+P-1, master T+P), for "
             "launchers that start every rank themselves (torchrun, Slurm, Kubernetes); every "
             "rank needs the same flags. -1: RANK (or a Slurm task's SLURM_PROCID) if set, else "
             "start every role on this host");
DEFINE_int32(world_size, 0,
             "with a rank: the number of processes, which must be trainers + ps + 1; 0: the "
             "WORLD_SIZE environment variable");
DEFINE_string(master_addr, "127.0.0.1",
              "rendezvous host, where rank 0 (trainer0) serves the store; a role started on its "
              "own uses MASTER_ADDR instead when this flag is not given");
DEFINE_int32(master_port, 0,
             "rendezvous port; 0: a free one when every role runs on this host, MASTER_PORT for a "
             "role started on its own");
DEFINE_int32(hosts, 0,
             "spread the roles over this many network namespaces on a bridge, each a host of its "
             "own (rank r on host r % hosts; needs root), PyTorch's the same way; implies "
             "--network_path. 0: every role on this host");
DEFINE_bool(network_path, false,
            "both sides on their network paths only: ddprpc with no same-host transport or "
            "same-host allreduce (gRPC, Gloo over TCP), PyTorch with TensorPipe's TCP transport "
            "and basic channel; implied by --hosts");
DEFINE_string(listen_address, "",
              "address this process serves RPC and Gloo on; empty: the local address that routes "
              "to the rendezvous host (127.0.0.1 when every role runs on this host)");

DECLARE_bool(same_host_transport);  // benchmarks/common.cc
DECLARE_bool(same_host_allreduce);

// Output and the PyTorch reference.
DEFINE_string(json, "ddp_rpc.json",
              "where to write every figure and the configuration (relative to the directory "
              "bazel run started in)");
DEFINE_bool(pytorch, true,
            "also run PyTorch's reference (benchmarks/reference/ddp_rpc.py with --python) on "
            "the same tables and trainers and print the ratio (not with --check_convergence or "
            "a role started on its own)");
DEFINE_int32(pytorch_iters, -1,
             "measured iterations of PyTorch's reference; -1: --iters (the report says so when "
             "the two sides differ)");
DEFINE_int32(pytorch_warmup, -1, "warm-up iterations of PyTorch's reference; -1: --warmup");
DEFINE_int32(pairs, 1,
             "rounds of interleaved runs: ddprpc (once per --dense_kernel), then PyTorch's "
             "reference; each ratio printed is the median of the rounds' ratios, so that drift "
             "of the machine between runs cannot favour one side");
DEFINE_string(pytorch_script, "", "path of the PyTorch reference script (default: benchmarks/reference/ddp_rpc.py "
              "from this binary's runfiles)");
DEFINE_int32(timeout_s, 1800, "wall-clock limit of the whole run, in seconds (stops every process)");
DEFINE_int32(rpc_timeout_s, 60,
             "deadline of each RPC, in seconds: a stopped or unreachable worker ends the job within it");

namespace rpc = ddprpc::rpc;
namespace bench = ddprpc::benchmarks;
namespace models = ddprpc::models;

namespace {

constexpr int kTrainingFailed = 1;
constexpr int kUsageError = 2;
constexpr int kNotConverged = 3;
constexpr double kMinLossFall = 0.10;  // --check_convergence: last <= 90% of first

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "ddp_rpc: %s (see --help)\n", message.c_str());
  std::exit(kUsageError);
}

// --dense_kernel as a list (validated by check_flags).
std::vector<models::DenseKernel> dense_kernels() {
  std::vector<models::DenseKernel> out;
  std::string why;
  if (!models::parse_dense_kernels(FLAGS_dense_kernel, &out, &why)) {
    usage_error("--dense_kernel: " + why);
  }
  return out;
}

std::vector<models::HybridTrainerOptions::Add> adds();

// Every trainer of the world: --trainers, then the standbys of --add.
int all_trainers() { return FLAGS_trainers + static_cast<int>(adds().size()); }

models::HybridWorld world() { return models::HybridWorld(all_trainers(), FLAGS_ps); }

// ---------------------------------------------------------------------------
// Placement: which role this process runs and where the rendezvous is.

struct Placement {
  int rank = -1;  // -1: start every role on this host
  std::string master_addr;
  int master_port = 0;
};

// Flags win over the launcher's environment: torchrun's (RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT), which is also how the local launch tells its
// children their rank, or a Slurm task's (rpc/rendezvous/launch_env.h).
Placement placement() {
  rpc::LaunchEnv env;
  try {
    env = rpc::launch_env();
  } catch (const std::invalid_argument& e) {
    usage_error(e.what());
  }
  Placement p;
  p.rank = FLAGS_rank >= 0 ? FLAGS_rank : env.rank;
  p.master_addr = FLAGS_master_addr;
  p.master_port = FLAGS_master_port;
  if (p.rank < 0) return p;  // the local launch (picks a port when it is 0)

  if (gflags::GetCommandLineFlagInfoOrDie("master_addr").is_default && !env.master_addr.empty()) {
    p.master_addr = env.master_addr;
  }
  if (p.master_port == 0) p.master_port = env.master_port;
  const int world = all_trainers() + FLAGS_ps + 1;
  const int world_size = FLAGS_world_size > 0 ? FLAGS_world_size : env.world_size;
  if (world_size <= 0) usage_error("a rank needs --world_size (or WORLD_SIZE, SLURM_NTASKS)");
  if (world_size != world) {
    usage_error(absl::StrFormat(
        "world size %d does not match --trainers=%d --ps=%d%s: the ranks are trainers 0..%d, "
        "parameter servers %d..%d and the master %d, so the world size must be %d",
        world_size, FLAGS_trainers, FLAGS_ps,
        adds().empty() ? "" : absl::StrCat(" and ", adds().size(), " --add standby trainer(s)"),
        all_trainers() - 1, all_trainers(), world - 2, world - 1, world));
  }
  if (p.rank >= world) {
    usage_error(absl::StrFormat("rank %d is outside the world of %d processes", p.rank, world));
  }
  if (p.master_port <= 0 || p.master_port > 65535) {
    usage_error(
        "a role started on its own needs the rendezvous port, the same on every rank: "
        "--master_port or MASTER_PORT");
  }
  return p;
}

// --kill, parsed; exits on what it cannot parse.
std::vector<models::HybridTrainerOptions::Kill> kills() {
  using Role = models::HybridTrainerOptions::Role;
  std::vector<models::HybridTrainerOptions::Kill> out;
  for (absl::string_view item : absl::StrSplit(FLAGS_kill, ',', absl::SkipEmpty())) {
    models::HybridTrainerOptions::Kill k;
    std::vector<absl::string_view> parts = absl::StrSplit(item, '@');
    bool named = parts.size() == 2;
    if (named && absl::ConsumePrefix(&parts[0], "trainer")) {
      k.role = Role::kTrainer;
    } else if (named && absl::ConsumePrefix(&parts[0], "ps")) {
      k.role = Role::kPs;
    } else {
      named = false;
    }
    if (!named || !absl::ConsumePrefix(&parts[1], "iter") ||
        !absl::SimpleAtoi(parts[0], &k.index) ||
        !absl::SimpleAtoi(parts[1], &k.iteration)) {
      usage_error(absl::StrCat("--kill: '", item, "' is not trainerN@iterK or psN@iterK"));
    }
    const int count = k.role == Role::kPs ? FLAGS_ps : FLAGS_trainers;
    if (k.index < 0 || k.index >= count || k.iteration < 0 ||
        k.iteration >= FLAGS_warmup + FLAGS_iters) {
      usage_error(absl::StrCat("--kill: '", item, "': no such worker or iteration"));
    }
    if (k.role == Role::kPs && !FLAGS_elastic) {
      usage_error(absl::StrCat("--kill: '", item, "': killing a parameter server needs --elastic"));
    }
    out.push_back(k);
  }
  return out;
}

// --add, parsed; exits on what it cannot parse.
std::vector<models::HybridTrainerOptions::Add> adds() {
  std::vector<models::HybridTrainerOptions::Add> out;
  for (absl::string_view item : absl::StrSplit(FLAGS_add, ',', absl::SkipEmpty())) {
    models::HybridTrainerOptions::Add a;
    absl::string_view rest = item;
    if (!absl::ConsumePrefix(&rest, "trainer@iter") || !absl::SimpleAtoi(rest, &a.iteration)) {
      usage_error(absl::StrCat("--add: '", item, "' is not trainer@iterK"));
    }
    if (a.iteration < 0 || a.iteration >= FLAGS_warmup + FLAGS_iters) {
      usage_error(absl::StrCat("--add: '", item, "': no such iteration"));
    }
    if (!FLAGS_elastic) usage_error(absl::StrCat("--add: '", item, "' needs --elastic"));
    out.push_back(a);
  }
  return out;
}

// The workload of the flags, as the trainer library takes it.
models::HybridTrainerOptions trainer_options() {
  models::HybridTrainerOptions o;
  o.trainers = FLAGS_trainers;
  o.ps = FLAGS_ps;
  o.num_embeddings = FLAGS_num_embeddings;
  o.embedding_dim = FLAGS_embedding_dim;
  o.iters = FLAGS_iters;
  o.warmup = FLAGS_warmup;
  o.batches_per_iter = FLAGS_batches_per_iter;
  o.lr = FLAGS_lr;
  o.seed = FLAGS_seed;
  o.learnable_target = FLAGS_check_convergence;
  o.sparse = FLAGS_sparse;
  o.sequential_lookups = FLAGS_lookups == "sequential";
  o.dense_kernel = dense_kernels()[0];
  o.backend = FLAGS_backend == "nccl" ? models::CollectiveBackend::kNccl
                                      : models::CollectiveBackend::kGloo;
  o.run_timeout = absl::Seconds(FLAGS_timeout_s);
  o.collective_timeout = absl::Seconds(FLAGS_rpc_timeout_s);
  o.fetch_tables = FLAGS_check_convergence;
  o.elastic = FLAGS_elastic;
  o.checkpoint_every = FLAGS_checkpoint_every;
  o.replicate_checkpoints = FLAGS_replicate_checkpoints;
  o.kills = kills();
  o.adds = adds();
  const ddprpc::ddp::ProcessGroupOptions group = bench::group_options();
  o.same_host_allreduce = group.same_host_allreduce;
  o.max_spin = group.max_spin;
  return o;
}

// ---------------------------------------------------------------------------
// Trainer: trainer0 shows its progress on stderr.

models::HybridTrainerService::ProgressCallback trainer0_progress() {
  auto progress = std::make_shared<std::unique_ptr<bench::Progress>>();
  return [progress](const models::TrainerProgress& p) {
    if (p.iteration == 0) {
      *progress = std::make_unique<bench::Progress>("ddp_rpc: trainer0 iteration", p.total);
      return;
    }
    (*progress)->update(p.iteration,
                        absl::StrFormat("%s, trainer0 %.0f ex/s, mean loss %.4f",
                                        p.measured ? "measured" : "warm-up",
                                        p.seconds > 0 ? p.examples / p.seconds : 0.0, p.mean_loss));
  };
}

// ---------------------------------------------------------------------------
// Master: the run and its report.

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

// The percentiles, then the samples they come from: "seconds" and
// "examples" per measured iteration.
void json_percentiles(bench::Json& json, const Percentiles& p, const std::vector<double>& seconds,
                      const std::vector<double>& examples) {
  json.begin_object();
  for (int i = 0; i < 4; ++i) {
    json.key(absl::StrCat("p", kPcts[i])).begin_object();
    json.key("sec_per_iter").value(p.sec[i]).key("ex_per_sec").value(p.ex[i]);
    json.end_object();
  }
  json.key("seconds").begin_array();
  for (double v : seconds) json.value(v);
  json.end_array().key("examples").begin_array();
  for (double v : examples) json.value(v);
  json.end_array().end_object();
}

// How a table changed during training (--check_convergence).
struct TableChange {
  int64_t rows = 0, rows_changed = 0;
  double norm_before = 0, norm_after = 0;
};

// What the master hands the local launch: every trainer's samples, the
// wall time and the tables' changes; the report follows from it.
struct RunFigures {
  std::vector<models::TrainerResult> trainers;  // by rank
  double wall_s = 0;
  std::vector<TableChange> tables;  // with --check_convergence
  int64_t epoch = 1;                // --elastic: the membership's at the end
  std::vector<models::ShardRestore> restores;  // --elastic
  int64_t checkpoints = 0;                     // --elastic
};

RunFigures figures_of(const models::HybridRunResult& result) {
  RunFigures f;
  f.trainers = result.trainers;
  f.wall_s = result.wall_s;
  f.epoch = result.epoch;
  f.restores = result.restores;
  f.checkpoints = result.checkpoints;
  for (size_t i = 0; i < result.tables_before.size() && i < result.tables_after.size(); ++i) {
    const at::Tensor& before = result.tables_before[i];
    const at::Tensor& after = result.tables_after[i];
    TableChange t;
    t.rows = before.size(0);
    t.rows_changed = (after - before).abs().amax(1).gt(0).sum().item<int64_t>();
    t.norm_before = before.norm().item<double>();
    t.norm_after = after.norm().item<double>();
    f.tables.push_back(t);
  }
  return f;
}

// RunFigures as JSON and back: numbers exact (protobuf prints doubles so
// that they parse back to the same value), non-finite ones as null.
bench::JsonValue number_json(double v) {
  bench::JsonValue out;
  if (std::isfinite(v)) {
    out.set_number_value(v);
  } else {
    out.set_null_value(google::protobuf::NULL_VALUE);
  }
  return out;
}

template <typename T>
bench::JsonValue list_json(const std::vector<T>& values) {
  bench::JsonValue out;
  auto* list = out.mutable_list_value();
  for (T v : values) *list->add_values() = number_json(static_cast<double>(v));
  return out;
}

double json_double(const bench::JsonValue& v) {
  return v.kind_case() == bench::JsonValue::kNumberValue ? v.number_value() : std::nan("");
}

template <typename T>
std::vector<T> json_list(const bench::JsonValue& at, const std::string& key) {
  std::vector<T> out;
  const bench::JsonValue* list = bench::json_at(at, {key});
  if (list == nullptr) return out;
  for (const auto& v : list->list_value().values()) out.push_back(static_cast<T>(json_double(v)));
  return out;
}

bench::JsonValue to_result(const RunFigures& f) {
  bench::JsonValue out;
  auto& fields = *out.mutable_struct_value()->mutable_fields();
  fields["wall_s"] = number_json(f.wall_s);
  fields["epoch"] = number_json(static_cast<double>(f.epoch));
  fields["checkpoints"] = number_json(static_cast<double>(f.checkpoints));
  auto* restores = fields["restores"].mutable_list_value();
  for (const models::ShardRestore& r : f.restores) {
    auto& rf = *restores->add_values()->mutable_struct_value()->mutable_fields();
    rf["shard"] = number_json(r.shard);
    rf["lost_server"].set_string_value(r.lost_server);
    rf["restored_on"].set_string_value(r.restored_on);
    rf["source"].set_string_value(r.source);
    rf["epoch"] = number_json(static_cast<double>(r.epoch));
    rf["checkpoint_iteration"] = number_json(static_cast<double>(r.checkpoint_iteration));
    rf["updates_lost"] = number_json(static_cast<double>(r.updates_lost));
    rf["seconds"] = number_json(r.seconds);
  }
  auto* trainers = fields["trainers"].mutable_list_value();
  for (const auto& t : f.trainers) {
    auto& tf = *trainers->add_values()->mutable_struct_value()->mutable_fields();
    tf["lost"].set_bool_value(t.lost);
    tf["joined"].set_bool_value(t.joined);
    tf["first_iteration"] = number_json(t.first_iteration);
    tf["lost_reason"].set_string_value(t.lost_reason);
    tf["dropped_batches"] = number_json(t.dropped_batches);
    tf["recovery_s"] = list_json(t.recovery_s);
    tf["epoch"] = number_json(static_cast<double>(t.epoch));
    tf["seconds"] = list_json(t.seconds);
    tf["examples"] = list_json(t.examples);
    tf["losses"] = list_json(t.losses);
    tf["ms_per_batch"] =
        list_json(std::vector<double>{t.forward_ms, t.backward_ms, t.step_ms, t.release_ms});
  }
  auto* tables = fields["tables"].mutable_list_value();
  for (const auto& t : f.tables) {
    tables->add_values()->CopyFrom(list_json(
        std::vector<double>{static_cast<double>(t.rows), static_cast<double>(t.rows_changed),
                            t.norm_before, t.norm_after}));
  }
  return out;
}

bool from_result(const bench::JsonValue& v, RunFigures* f) {
  const bench::JsonValue* trainers = bench::json_at(v, {"trainers"});
  if (trainers == nullptr || !trainers->has_list_value()) return false;
  f->wall_s = bench::json_number(v, {"wall_s"}, 0);
  f->epoch = static_cast<int64_t>(bench::json_number(v, {"epoch"}, 1));
  f->checkpoints = static_cast<int64_t>(bench::json_number(v, {"checkpoints"}, 0));
  if (const bench::JsonValue* restores = bench::json_at(v, {"restores"})) {
    for (const auto& r : restores->list_value().values()) {
      models::ShardRestore restore;
      restore.shard = static_cast<int>(bench::json_number(r, {"shard"}, 0));
      auto text = [&r](const std::string& key) {
        const bench::JsonValue* s = bench::json_at(r, {key});
        return s == nullptr ? std::string() : s->string_value();
      };
      restore.lost_server = text("lost_server");
      restore.restored_on = text("restored_on");
      restore.source = text("source");
      restore.epoch = static_cast<int64_t>(bench::json_number(r, {"epoch"}, 0));
      restore.checkpoint_iteration =
          static_cast<int64_t>(bench::json_number(r, {"checkpoint_iteration"}, 0));
      restore.updates_lost = static_cast<int64_t>(bench::json_number(r, {"updates_lost"}, 0));
      restore.seconds = bench::json_number(r, {"seconds"}, 0);
      f->restores.push_back(std::move(restore));
    }
  }
  for (const auto& t : trainers->list_value().values()) {
    models::TrainerResult r;
    if (const bench::JsonValue* lost = bench::json_at(t, {"lost"})) r.lost = lost->bool_value();
    if (const bench::JsonValue* j = bench::json_at(t, {"joined"})) r.joined = j->bool_value();
    r.first_iteration = static_cast<int>(bench::json_number(t, {"first_iteration"}, 0));
    if (const bench::JsonValue* why = bench::json_at(t, {"lost_reason"})) {
      r.lost_reason = why->string_value();
    }
    r.dropped_batches = static_cast<int>(bench::json_number(t, {"dropped_batches"}, 0));
    r.epoch = static_cast<int64_t>(bench::json_number(t, {"epoch"}, 1));
    r.recovery_s = json_list<double>(t, "recovery_s");
    r.seconds = json_list<double>(t, "seconds");
    r.examples = json_list<int64_t>(t, "examples");
    r.losses = json_list<double>(t, "losses");
    const std::vector<double> ms = json_list<double>(t, "ms_per_batch");
    if (ms.size() != 4 && !r.lost) return false;
    if (r.lost) {
      f->trainers.push_back(std::move(r));
      continue;
    }
    r.forward_ms = ms[0];
    r.backward_ms = ms[1];
    r.step_ms = ms[2];
    r.release_ms = ms[3];
    f->trainers.push_back(std::move(r));
  }
  if (const bench::JsonValue* tables = bench::json_at(v, {"tables"})) {
    for (const auto& t : tables->list_value().values()) {
      const auto& n = t.list_value().values();
      if (n.size() != 4) return false;
      f->tables.push_back({static_cast<int64_t>(json_double(n[0])),
                           static_cast<int64_t>(json_double(n[1])), json_double(n[2]),
                           json_double(n[3])});
    }
  }
  return true;
}

// --check_convergence: the mean loss (over the trainers and an iteration's
// batches) of the last iteration must be kMinLossFall below the first one's,
// and every parameter server's table must have changed.
bool report_convergence(const RunFigures& f, std::ostream& out, bench::Json& json) {
  // Each iteration's mean over the trainers that ran it (a standby's losses
  // start where it joined).
  std::vector<double> loss(FLAGS_iters + FLAGS_warmup, 0.0);
  std::vector<int> ran(loss.size(), 0);
  for (const auto& trainer : f.trainers) {
    if (trainer.lost || !trainer.joined) continue;
    for (size_t i = 0; i < trainer.losses.size(); ++i) {
      const size_t at = static_cast<size_t>(trainer.first_iteration) + i;
      if (at >= loss.size()) break;
      loss[at] += trainer.losses[i];
      ++ran[at];
    }
  }
  for (size_t i = 0; i < loss.size(); ++i) loss[i] /= std::max(1, ran[i]);
  const double first = loss.front(), last = loss.back();
  const bool fell = last <= (1 - kMinLossFall) * first;
  out << absl::StrFormat(
      "Convergence (learnable target, seed %d): mean loss %.4f in the first iteration, %.4f in "
      "the last (%+.1f%%)%s\n",
      FLAGS_seed, first, last, 100 * (last / first - 1),
      fell ? "" : absl::StrFormat(": did not fall by %.0f%%", 100 * kMinLossFall));
  json.key("convergence").begin_object();
  json.key("loss_per_iter").begin_array();
  for (double l : loss) json.value(l);
  json.end_array();
  json.key("tables").begin_array();
  bool all_changed = !f.tables.empty();
  for (size_t i = 0; i < f.tables.size(); ++i) {
    const TableChange& t = f.tables[i];
    all_changed = all_changed && t.rows_changed > 0;
    std::string moved;  // --elastic: the server it was restored on
    for (const models::ShardRestore& r : f.restores) {
      if (r.shard == static_cast<int>(i)) {
        moved = absl::StrCat(" (its shard now on ", r.restored_on, ")");
      }
    }
    out << absl::StrFormat("  ps%d%s: %d of %d embedding rows changed, weight norm %.4f -> %.4f\n",
                           i, moved, t.rows_changed, t.rows, t.norm_before, t.norm_after);
    json.begin_object().key("rows_changed").value(t.rows_changed);
    json.key("norm_before").value(t.norm_before).key("norm_after").value(t.norm_after).end_object();
  }
  json.end_array();
  const bool passed = fell && all_changed;
  json.key("passed").value(passed).end_object();
  out << "Convergence check: " << (passed ? "passed" : "FAILED") << "\n";
  return passed;
}

// The report of a run with dense layers on `kernel`: its table in *text,
// every figure in *report_json. False when --check_convergence failed.
bool report(const RunFigures& f, const std::string& kernel, std::string* text,
            bench::JsonValue* report_json) {
  const int trainers = static_cast<int>(f.trainers.size());
  std::ostringstream out;
  out << "------------------ ddprpc Distributed Benchmark (DDP and RPC), dense layers on "
      << kernel << " ------------------\n";
  out << "                sec/iter    ex/sec      sec/iter    ex/sec      sec/iter    ex/sec      "
         "sec/iter    ex/sec\n";
  bench::Json json;
  json.begin_object();
  std::vector<double> all_sec(FLAGS_iters, 0.0), all_ex(FLAGS_iters, 0.0);
  std::vector<double> phases(4, 0.0);
  int survivors = 0, dropped = 0;
  std::vector<double> recovery;  // per loss: the slowest survivor's seconds
  std::vector<std::string> lost;
  std::vector<std::string> joined;  // --add: "trainer<r> at iteration <k>"
  for (const auto& t : f.trainers) survivors += t.lost || !t.joined ? 0 : 1;
  for (int r = 0; r < trainers; ++r) {
    const models::TrainerResult& t = f.trainers[r];
    if (!t.joined) {
      out << absl::StrFormat(" Trainer%d:  standby, never joined (the run ended first)\n", r);
      json.key(absl::StrCat("trainer", r)).begin_object().key("joined").value(false).end_object();
      continue;
    }
    if (r >= FLAGS_trainers) {
      joined.push_back(absl::StrCat("trainer", r, " at iteration ", t.first_iteration));
    }
    if (t.lost) {
      out << absl::StrFormat(" Trainer%d:  lost: %s\n", r, t.lost_reason.substr(0, 160));
      json.key(absl::StrCat("trainer", r)).begin_object().key("lost").value(t.lost_reason).end_object();
      lost.push_back(absl::StrCat("trainer", r));
      continue;
    }
    dropped = std::max(dropped, t.dropped_batches);
    for (size_t i = 0; i < t.recovery_s.size(); ++i) {
      if (recovery.size() <= i) recovery.resize(i + 1, 0.0);
      recovery[i] = std::max(recovery[i], t.recovery_s[i]);
    }
    const double phase_ms[] = {t.forward_ms, t.backward_ms, t.step_ms, t.release_ms};
    for (int i = 0; i < 4; ++i) phases[i] += phase_ms[i] / survivors;
    const std::vector<double>& sec = t.seconds;
    std::vector<double> exd(t.examples.begin(), t.examples.end());
    Percentiles p = percentiles(sec, exd);
    out << pct_line(absl::StrCat("Trainer", r), p) << "\n";
    json.key(absl::StrCat("trainer", r));
    json_percentiles(json, p, sec, exd);
    // A standby's measured iterations start where it joined.
    const size_t from = static_cast<size_t>(std::max(0, t.first_iteration - FLAGS_warmup));
    for (size_t i = 0; i < sec.size() && from + i < all_sec.size(); ++i) {
      all_sec[from + i] = std::max(all_sec[from + i], sec[i]);
      all_ex[from + i] += exd[i];
    }
  }
  Percentiles all = percentiles(all_sec, all_ex);
  out << pct_line(survivors < trainers ? absl::StrCat("All (", survivors, " of ", trainers, ")")
                                       : std::string("All"),
                  all)
      << "\n";
  if (FLAGS_elastic) {
    int64_t updates_lost = 0;
    std::vector<std::string> servers_lost;
    for (const models::ShardRestore& r : f.restores) {
      updates_lost += r.updates_lost;
      if (std::find(servers_lost.begin(), servers_lost.end(), r.lost_server) ==
          servers_lost.end()) {
        servers_lost.push_back(r.lost_server);
      }
    }
    out << absl::StrFormat(
        "Elastic: membership epoch %d at the end; trainers lost: %s; trainers joined: %s; "
        "parameter servers lost: %s; "
        "batches dropped on each survivor: %d at most (of %d per trainer); from the start of a "
        "failure (a dropped batch, a failed collective) to the next completed batch: %s s; shard "
        "checkpoints taken: %d; "
        "parameter-server updates lost: %d\n",
        f.epoch, lost.empty() ? "none" : absl::StrJoin(lost, ", "),
        joined.empty() ? "none" : absl::StrJoin(joined, ", "),
        servers_lost.empty() ? "none" : absl::StrJoin(servers_lost, ", "), dropped,
        (FLAGS_warmup + FLAGS_iters) * FLAGS_batches_per_iter,
        recovery.empty() ? std::string("-")
                         : absl::StrJoin(recovery, ", ", [](std::string* o, double s) {
                             absl::StrAppend(o, absl::StrFormat("%.3f", s));
                           }),
        f.checkpoints, updates_lost);
    for (const models::ShardRestore& r : f.restores) {
      out << absl::StrFormat(
          "  shard %d: lost with %s, restored on %s (epoch %d) from its %s of iteration %d in "
          "%.3f s; %d updates lost (optimizer steps the surviving shards had applied since)\n",
          r.shard, r.lost_server, r.restored_on, r.epoch, r.source, r.checkpoint_iteration,
          r.seconds, r.updates_lost);
    }
    json.key("elastic").begin_object().key("epoch").value(static_cast<double>(f.epoch));
    json.key("trainers_lost").begin_array();
    for (const std::string& name : lost) json.value(name);
    json.end_array().key("trainers_joined").begin_array();
    for (const std::string& name : joined) json.value(name);
    json.end_array().key("servers_lost").begin_array();
    for (const std::string& name : servers_lost) json.value(name);
    json.end_array().key("batches_dropped").value(dropped);
    json.key("recovery_s").begin_array();
    for (double s : recovery) json.value(s);
    json.end_array().key("checkpoints").value(static_cast<double>(f.checkpoints));
    json.key("updates_lost").value(static_cast<double>(updates_lost));
    json.key("restores").begin_array();
    for (const models::ShardRestore& r : f.restores) {
      json.begin_object().key("shard").value(r.shard).key("lost_server").value(r.lost_server);
      json.key("restored_on").value(r.restored_on).key("source").value(r.source);
      json.key("epoch").value(static_cast<double>(r.epoch));
      json.key("checkpoint_iteration").value(static_cast<double>(r.checkpoint_iteration));
      json.key("updates_lost").value(static_cast<double>(r.updates_lost));
      json.key("seconds").value(r.seconds).end_object();
    }
    json.end_array().end_object();
  }
  json.key("all");
  json_percentiles(json, all, all_sec, all_ex);
  json.key("wall_s").value(f.wall_s);
  static const char* kPhases[] = {"forward", "backward", "optimizer_step", "context_release"};
  out << absl::StrFormat("Where a batch goes (mean over trainers, ms): ");
  json.key("ms_per_batch").begin_object();
  for (int i = 0; i < 4; ++i) {
    out << absl::StrFormat("%s %.2f%s", kPhases[i], phases[i], i < 3 ? ", " : "\n");
    json.key(kPhases[i]).value(phases[i]);
  }
  json.end_object();
  bool converged = true;
  if (FLAGS_check_convergence) converged = report_convergence(f, out, json);
  json.end_object();
  *text = out.str();
  *report_json = json.root();
  return converged;
}

// ---------------------------------------------------------------------------
// Info header and the JSON file.

std::string run_or_empty(const std::vector<std::string>& argv) {
  std::string output;
  return bench::run_command(argv, &output) == 0 ? output : "";
}

// `name` and its version from the headers, with the Debian package's version
// when dpkg knows it (Gloo's headers say 0.5.0 for years of commits; the
// package names the commit).
std::string cuda_versions() {
#ifdef DDPRPC_WITH_NCCL
  int nccl = 0, runtime = 0, driver = 0, gpus = 0;
  ncclGetVersion(&nccl);
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch, older ones * 1000.
  const int major_unit = nccl >= 20900 ? 10000 : 1000;
  return absl::StrFormat(
      "NCCL %d.%d.%d, CUDA runtime %d.%d, %s, %d GPU(s) visible", nccl / major_unit,
      nccl % major_unit / 100, nccl % 100, runtime / 1000, runtime % 1000 / 10,
      driver > 0 ? absl::StrFormat("driver %d.%d", driver / 1000, driver % 1000 / 10)
                 : std::string("no CUDA driver"),
      gpus);
#else
  return "NCCL/CUDA not built in (no NCCL at build time: neither /usr/local/cuda nor a CUDA wheel's nvidia-nccl)";
#endif
}

void print_info(const std::string& processes) {
  absl::PrintF("---------- Info ---------\n");
  absl::PrintF("* ddprpc: %s, %s; gRPC %s; %s\n",
               bench::libtorch_version(),
               at::hasCUDA() ? "with CUDA" : "CPU only", grpc::Version(),
               absl::StrFormat("libtorch's Gloo (headers %d.%d.%d)", GLOO_VERSION_MAJOR,
                               GLOO_VERSION_MINOR, GLOO_VERSION_PATCH));
  absl::PrintF("* %s\n", bench::versions());
  absl::PrintF("* %s; DDP backend: %s\n", cuda_versions(), FLAGS_backend);
  absl::PrintF("* CPUs: %d; allocator: %s; %s\n", bench::cpu_count(), bench::allocator_name(),
               processes);
  absl::PrintF(
      "* embedding tables: %d x %d each, fc_in = %d; %d measured + %d warm-up iterations of %d "
      "batches; SGD lr %g; seed %d%s\n",
      FLAGS_num_embeddings, FLAGS_embedding_dim, FLAGS_ps * FLAGS_embedding_dim, FLAGS_iters,
      FLAGS_warmup, FLAGS_batches_per_iter, FLAGS_lr, FLAGS_seed,
      FLAGS_check_convergence ? "; learnable target (--check_convergence)" : "");
  absl::PrintF(
      "* lookups: %s; dense layers on: %s; %s embedding gradients; percentiles: numpy's linear "
      "interpolation, both sides\n",
      FLAGS_lookups, FLAGS_dense_kernel, FLAGS_sparse ? "sparse" : "dense");
  const std::string topo = run_or_empty({"nvidia-smi", "topo", "-m"});
  if (!topo.empty()) absl::PrintF("---------- nvidia-smi topo -m ---------\n%s", topo);
  std::fflush(stdout);
}

// Every figure of the local launch: the first run of each side in full,
// then each round's "All" p50 and the ratios.
// The runs of both sides, round by round (rounds.h): each run's figures
// as the master wrote them (PyTorch's as its script did).
using Report = bench::Rounds<bench::JsonValue>;

double all_p50(const bench::JsonValue& figures);

// PyTorch's All p50 over ours, per round (sec/iter: > 1 means ddprpc is faster).
bench::RoundSpeedups round_ratios(const Report& r, const std::string& kernel) {
  return r.speedups(kernel, all_p50, /*higher_is_better=*/false);
}

void write_json(const Report& r) {
  bench::Json config;
  config.begin_object();
  config.key("trainers").value(FLAGS_trainers).key("ps").value(FLAGS_ps);
  config.key("num_embeddings").value(FLAGS_num_embeddings);
  config.key("embedding_dim").value(FLAGS_embedding_dim);
  config.key("iters").value(FLAGS_iters).key("warmup").value(FLAGS_warmup);
  config.key("batches_per_iter").value(FLAGS_batches_per_iter).key("lr").value(FLAGS_lr);
  config.key("seed").value(static_cast<double>(FLAGS_seed));
  config.key("check_convergence").value(FLAGS_check_convergence);
  config.key("backend").value(FLAGS_backend).key("cpus").value(bench::cpu_count());
  config.key("allocator").value(bench::allocator_name());
  config.versions();
  config.key("lookups").value(FLAGS_lookups).key("dense_kernel").value(FLAGS_dense_kernel);
  config.key("pairs").value(FLAGS_pairs).key("sparse").value(FLAGS_sparse);
  config.key("percentiles").value("numpy linear interpolation");
  config.end_object();
  const std::string first_kernel = models::dense_kernel_name(dense_kernels()[0]);
  bench::JsonValue none;
  none.set_null_value(google::protobuf::NULL_VALUE);
  bench::Json json;
  json.begin_object();
  json.key("config").value(config.root());
  // The first round's figures, and every round's All p50.
  json.key("ddprpc").value(r.ours.count(first_kernel) ? r.ours.at(first_kernel)[0] : none);
  json.key("ddprpc_by_kernel").begin_object();
  for (const auto& [kernel, rounds] : r.ours) json.key(kernel).value(rounds[0]);
  json.end_object();
  json.key("pytorch").value(r.theirs.empty() ? none : r.theirs[0]);
  json.key("rounds").begin_object();
  for (const auto& [kernel, rounds] : r.ours) {
    json.key(absl::StrCat("ddprpc_", kernel, "_all_p50")).begin_array();
    for (const bench::JsonValue& figures : rounds) json.value(all_p50(figures));
    json.end_array();
  }
  json.key("pytorch_all_p50").begin_array();
  for (const bench::JsonValue& figures : r.theirs) json.value(all_p50(figures));
  json.end_array();
  json.key("ratios").begin_object();
  for (const auto& [kernel, rounds] : r.ours) {
    const bench::RoundSpeedups ratios = round_ratios(r, kernel);
    if (!ratios.per_round.empty()) json.key(kernel).value(ratios.json());
  }
  json.end_object().end_object().end_object();
  const std::string path = bench::output_path(FLAGS_json);
  if (json.write(path)) std::printf("wrote %s\n", path.c_str());
}

// ---------------------------------------------------------------------------
// One process of the world.

// The master's part: trains (models::run_hybrid_training), then reports
// (a role started on its own) or hands its figures to the local launch.
// Returns the exit code: 0, kTrainingFailed or kNotConverged.
int run_master(bool standalone) {
  RunFigures figures;
  try {
    figures = figures_of(models::run_hybrid_training(trainer_options()));
  } catch (const models::HybridTrainingError& e) {
    // Every failure: the first one in rank order may only be a symptom
    // (e.g. an allreduce broken because another trainer stopped).
    for (const auto& f : e.failures()) {
      std::fprintf(stderr, "ddp_rpc: training failed on trainer%d: %s\n", f.trainer,
                   f.message.c_str());
    }
    return kTrainingFailed;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_rpc: training failed: %s\n", e.what());
    return kTrainingFailed;
  }
  const std::string kernel = models::dense_kernel_name(dense_kernels()[0]);
  std::string text;
  bench::JsonValue report_json;
  const bool converged = report(figures, kernel, &text, &report_json);
  if (standalone) {
    std::printf("%sPyTorch reference not run (roles started on their own)\n", text.c_str());
    Report r;
    r.ours[kernel].push_back(report_json);
    write_json(r);
  } else {
    std::string error;
    if (!bench::write_result(to_result(figures), &error)) {
      std::fprintf(stderr, "ddp_rpc: cannot hand the figures back: %s\n", error.c_str());
      return kTrainingFailed;
    }
  }
  return converged ? 0 : kNotConverged;
}

int worker(const Placement& where) {
  const models::HybridWorld roles = world();
  const int rank = where.rank;
  at::set_num_threads(1);  // as the reference: many processes share the cores
  rpc::RpcBackendOptions options = bench::backend_options();
  options.allow_insecure = bench::allow_insecure();
  options.num_worker_threads = FLAGS_num_worker_threads;
  options.rpc_timeout = absl::Seconds(FLAGS_rpc_timeout_s);
  options.init_method = absl::StrCat("tcp://", where.master_addr, ":", where.master_port);
  options.listen_address = FLAGS_listen_address.empty()
                               ? bench::local_address_towards(where.master_addr)
                               : FLAGS_listen_address;
  if (options.listen_address.empty()) {
    usage_error(absl::StrCat("no local address routes to ", where.master_addr,
                             "; pass --listen_address"));
  }
  const bool standalone = !bench::started_by_run_roles();  // not started by the local launch
  if (standalone) {
    std::fprintf(stderr, "ddp_rpc: %s (rank %d) joining at %s:%d, serving on %s\n",
                 roles.name(rank).c_str(), where.rank, where.master_addr.c_str(),
                 where.master_port, options.listen_address.c_str());
    if (roles.is_master(rank)) {
      print_info(absl::StrFormat("this process is the master (rank %d) of %d trainers + %d "
                                 "parameter servers + 1 master started on their own",
                                 where.rank, FLAGS_trainers, FLAGS_ps));
    }
  }
  // A trainer trains when the master reaches it; the tables are created
  // on the parameter servers by the master.
  std::unique_ptr<models::HybridTrainerService> trainer;
  std::unique_ptr<models::HybridServerService> server;
  if (roles.is_trainer(rank)) {
    trainer = std::make_unique<models::HybridTrainerService>(
        trainer_options(), rank == 0 ? trainer0_progress() : nullptr);
  }
  if (roles.is_ps(rank)) {
    server = std::make_unique<models::HybridServerService>(
        models::HybridServerOptions{FLAGS_checkpoint_dir,
                                    /*accept_injected_faults=*/!FLAGS_kill.empty()});
  }
  rpc::init_rpc(roles.name(rank), rank, roles.size(), options);
  int rc = 0;
  if (roles.is_master(rank)) rc = run_master(standalone);
  // A failed convergence check is still a complete run: shut down gracefully.
  rpc::shutdown(/*graceful=*/rc != kTrainingFailed);
  return rc;
}

// ---------------------------------------------------------------------------
// The local launch: every role on this host, then PyTorch's reference.

// "All" p50 sec/iter of a run's figures ({"all": {"p50": {"sec_per_iter": x ...),
// ours or PyTorch's; 0 when missing.
double all_p50(const bench::JsonValue& figures) {
  return bench::json_number(figures, {"all", "p50", "sec_per_iter"}, 0);
}

bool network_path() { return FLAGS_network_path || FLAGS_hosts > 0; }

// The network namespaces of --hosts while the coordinator runs (it owns them).
const bench::NetworkHosts* g_hosts = nullptr;
const bench::NetworkHosts* network_hosts() { return g_hosts; }

// Puts the ranks of `launch` on --hosts' namespaces (rank 0, the store, on the first).
void place_on_hosts(bench::RolesOptions* launch) {
  if (const bench::NetworkHosts* hosts = network_hosts()) hosts->place(launch);
}

int pytorch_iters() { return FLAGS_pytorch_iters >= 0 ? FLAGS_pytorch_iters : FLAGS_iters; }
int pytorch_warmup() { return FLAGS_pytorch_warmup >= 0 ? FLAGS_pytorch_warmup : FLAGS_warmup; }

// Runs the reference with the same workload; returns its figures (null
// when it failed). `full`: prints its table, else only its "All" line.
bench::JsonValue run_pytorch_reference(const std::string& script, const std::string& tmp, bool full) {
  std::fprintf(stderr, "ddp_rpc: running PyTorch's reference (%s)\n", script.c_str());
  std::vector<std::string> args = {
      "--trainers", absl::StrCat(FLAGS_trainers), "--ps", absl::StrCat(FLAGS_ps), "--emb",
      absl::StrCat(FLAGS_num_embeddings), "--dim", absl::StrCat(FLAGS_embedding_dim),
      "--iters", absl::StrCat(pytorch_iters()), "--warmup", absl::StrCat(pytorch_warmup()),
      "--lookups", FLAGS_lookups, "--sparse", FLAGS_sparse ? "1" : "0"};
  if (network_path()) args.push_back("--network_path");
  bench::ReferenceRun run;
  if (network_hosts()) {
    // Its ranks placed as ours, each namespace's one interface named for
    // TensorPipe and Gloo.
    bench::RolesOptions ranks;
    ranks.nprocs = world().size();
    ranks.timeout = absl::Seconds(FLAGS_timeout_s);
    ranks.env = {{"TP_SOCKET_IFNAME", "eth0"}, {"GLOO_SOCKET_IFNAME", "eth0"}};
    place_on_hosts(&ranks);
    run = bench::run_reference_ranks(script, args, ranks);
  } else {
    args.insert(args.end(), {"--port", absl::StrCat(rpc::pick_free_port())});
    run = bench::run_reference(script, args);
  }
  const std::string& output = run.output;
  if (full) {
    std::printf("------------------ PyTorch reference (same machine, same run) ---------------------\n");
    std::printf("(%d measured + %d warm-up iterations of 10 batches, lr 0.05, %s lookups, its own "
                "random data)\n",
                pytorch_iters(), pytorch_warmup(), FLAGS_lookups.c_str());
  }
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    // Its table and summary, without its processes' log lines (nor the
    // launcher's "[rank N] " before them).
    if (line.rfind("[rank ", 0) == 0 && line.find("] ") != std::string::npos) {
      line = line.substr(line.find("] ") + 2);
    }
    const bool all_row = line.find("All:") != std::string::npos;
    if ((full && (line.find(": p50:") != std::string::npos || line.rfind("PyTorch", 0) == 0 ||
                  line.rfind("wall", 0) == 0)) ||
        (!full && all_row)) {
      std::printf("%s%s\n", full ? "" : "PyTorch          ", line.c_str());
    }
  }
  if (!run.ok()) std::printf("PyTorch reference failed (%s)\n", run.failure().c_str());
  std::fflush(stdout);
  return run.report;
}

// Starts every role of one run of ours with `kernel`; prints its table
// (`full`) or its "All" line. Returns 0 with the master's figures in *json,
// or the exit code of a failed run.
int run_ours(int argc, char** argv, const std::string& kernel, bool full, bench::JsonValue* json) {
  const models::HybridWorld roles = world();
  bench::RolesOptions launch;
  launch.nprocs = roles.size();
  launch.args = {"--dense_kernel=" + kernel};
  launch.master_addr = FLAGS_master_addr;
  launch.master_port = FLAGS_master_port;
  launch.timeout = absl::Seconds(FLAGS_timeout_s);
  launch.grace_period = absl::Seconds(20);  // let the master report which call failed
  place_on_hosts(&launch);
  std::fprintf(stderr, "ddp_rpc: starting %d processes (dense layers on %s)\n", roles.size(),
               kernel.c_str());
  const bench::RolesResult r = bench::run_roles(argc, argv, launch);
  // The master's figures, also when the convergence check failed.
  std::string table;
  json->Clear();
  RunFigures figures;
  if (r.has_result && from_result(r.result, &figures)) report(figures, kernel, &table, json);
  if (full) {
    std::printf("%s", table.c_str());  // also when the convergence check failed
  } else {
    std::istringstream lines(table);
    for (std::string line; std::getline(lines, line);) {
      if (line.find("All:") != std::string::npos) {
        std::printf("ddprpc %-9s %s\n", kernel.c_str(), line.c_str());
      }
    }
  }
  std::fflush(stdout);  // the table shows before PyTorch's reference starts, also in a pipe
  if (r.exit_code == kNotConverged && roles.is_master(r.failed_rank)) {
    std::fprintf(stderr, "ddp_rpc: the convergence check failed (see the report above)\n");
    return kNotConverged;
  }
  if (r.exit_code != 0) {
    std::string who = r.failed_rank < 0 ? "" : roles.name(r.failed_rank) + ": ";
    std::fprintf(stderr, "ddp_rpc: failed: %s%s\n", who.c_str(), r.message.c_str());
    return kTrainingFailed;
  }
  return 0;
}

// The ratios of the rounds, one line per kernel.
void print_ratios(const Report& r) {
  if (FLAGS_batches_per_iter != 10) return;  // sec/iter compare only for the same work
  if (pytorch_iters() != FLAGS_iters || pytorch_warmup() != FLAGS_warmup) {
    std::printf("NOTE: PyTorch measured %d iterations after %d warm-up, ddprpc %d after %d "
                "(--pytorch_iters, --pytorch_warmup)\n",
                pytorch_iters(), pytorch_warmup(), FLAGS_iters, FLAGS_warmup);
  }
  for (models::DenseKernel k : dense_kernels()) {
    const std::string kernel = models::dense_kernel_name(k);
    const bench::RoundSpeedups ratios = round_ratios(r, kernel);
    if (ratios.per_round.empty()) continue;
    const double m = ratios.median();
    std::printf(
        "All p50 sec/iter, PyTorch / ddprpc with %s dense layers (%s): %.2fx%s, median of %zu "
        "interleaved round(s) [%s]; ddprpc %s\n",
        kernel.c_str(),
        k == models::DenseKernel::kAten ? "the same kernels: the runtimes alone"
                                        : "our kernels: the product",
        m, m >= 1 ? " (ddprpc faster)" : " (ddprpc slower)", ratios.per_round.size(),
        ratios.list().c_str(),
        absl::StrFormat("%.3fs, PyTorch %.3fs in the first round", all_p50(r.ours.at(kernel)[0]),
                        all_p50(r.theirs[0]))
            .c_str());
  }
  const auto kernels = dense_kernels();
  if (!models::xnnpack_linear_available() &&
      std::find(kernels.begin(), kernels.end(), models::DenseKernel::kXnnpack) == kernels.end()) {
    std::printf(
        "The product ratio is the runtime ratio here: this libtorch has no XNNPACK, so ddprpc's "
        "dense layers run on libtorch's own Linear, as PyTorch's do\n");
  }
}

int coordinator(int argc, char** argv) {
  // Removed when the coordinator returns.
  const std::unique_ptr<bench::NetworkHosts> hosts = bench::hosts_from_flag("ddp_rpc", FLAGS_hosts);
  const std::string where = hosts ? hosts->describe() : "this host";
  g_hosts = hosts.get();
  struct Forget {
    ~Forget() { g_hosts = nullptr; }
  } forget;
  print_info(absl::StrFormat("processes on %s: %d trainers + %d parameter servers + 1 master%s",
                             where, FLAGS_trainers, FLAGS_ps,
                             network_path() ? "; both sides on their network paths only (ddprpc: "
                                              "gRPC and Gloo over TCP; PyTorch: TensorPipe uv + "
                                              "basic, Gloo)"
                                            : ""));
  const std::string script =
      bench::reference_script(FLAGS_pytorch_script, "benchmarks/reference/ddp_rpc.py");
  const bool pytorch =
      FLAGS_pytorch && !FLAGS_check_convergence && FLAGS_kill.empty() && FLAGS_add.empty() &&
      !script.empty();
  bench::RoundsPlan plan;
  plan.name = "ddp_rpc";
  plan.rounds = FLAGS_pairs;
  for (models::DenseKernel k : dense_kernels()) plan.variants.push_back(models::dense_kernel_name(k));
  plan.with_theirs = pytorch;
  Report report;
  const std::string tmp = bench::temp_path("ddp_rpc_ref");
  const int rc = bench::run_rounds<bench::JsonValue>(
      plan,
      [&](const std::string& kernel, int round, bench::JsonValue* json) {
        return run_ours(argc, argv, kernel, round == 0, json);
      },
      [&](int round, bench::JsonValue* json) {
        *json = run_pytorch_reference(script, tmp, round == 0);
        return all_p50(*json) > 0;
      },
      &report);
  if (rc != 0) return rc;
  if (FLAGS_check_convergence) {
    std::printf("PyTorch reference not run (--check_convergence)\n");
  } else if (!FLAGS_kill.empty() || !FLAGS_add.empty()) {
    std::printf("PyTorch reference not run (--kill, --add: PyTorch's RPC has no elastic training)\n");
  } else if (!pytorch) {
    std::printf("PyTorch reference not run (--pytorch=false or no reference script found)\n");
  }
  print_ratios(report);
  write_json(report);
  return 0;
}

void check_flags() {
  if (FLAGS_backend != "gloo" && FLAGS_backend != "nccl") usage_error("--backend must be gloo or nccl");
  if (FLAGS_backend == "nccl" && !ddprpc::ddp::nccl_available()) {
    usage_error("--backend=nccl needs a CUDA build and a visible GPU");
  }
  if (FLAGS_trainers < 1 || FLAGS_ps < 1 || FLAGS_iters < 1 || FLAGS_batches_per_iter < 1) {
    usage_error("--trainers, --ps, --iters and --batches_per_iter must be at least 1");
  }
  if (FLAGS_warmup < 0 || FLAGS_embedding_dim < 1 || FLAGS_num_embeddings < 1) {
    usage_error("--warmup must be at least 0, --embedding_dim and --num_embeddings at least 1");
  }
  if (FLAGS_check_convergence && FLAGS_num_embeddings < models::kHybridClasses) {
    usage_error("--check_convergence needs --num_embeddings of at least 8 (a row per class)");
  }
  if (FLAGS_master_port < 0 || FLAGS_master_port > 65535) usage_error("--master_port is 0..65535");
  if (FLAGS_lookups != "concurrent" && FLAGS_lookups != "sequential") {
    usage_error("--lookups must be concurrent or sequential");
  }
  if (FLAGS_dense_kernel.empty()) FLAGS_dense_kernel = models::default_dense_kernels();
  dense_kernels();  // exits on a name it does not know
  if (FLAGS_pairs < 1) usage_error("--pairs must be at least 1");
  kills();  // exit on what they cannot parse
  adds();
  if (FLAGS_elastic && FLAGS_backend != "gloo") usage_error("--elastic needs --backend=gloo");
  if (FLAGS_checkpoint_every < 0) usage_error("--checkpoint_every must be at least 0");
  if (struct stat st; !FLAGS_checkpoint_dir.empty() &&
                      (::stat(FLAGS_checkpoint_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))) {
    usage_error(absl::StrCat("--checkpoint_dir: '", FLAGS_checkpoint_dir, "' is not a directory"));
  }
  if (FLAGS_hosts < 0 || FLAGS_hosts > 9) usage_error("--hosts is 0..9");
  if (FLAGS_pytorch_iters == 0 || FLAGS_pytorch_iters < -1 || FLAGS_pytorch_warmup < -1) {
    usage_error("--pytorch_iters must be at least 1 (or -1), --pytorch_warmup at least 0 (or -1)");
  }
}

// Every value of flag `name` on the command line, comma-joined (gflags
// keeps only the last of a repeated flag): --kill and --add may be given
// once per fault.
std::string every_value(int argc, char** argv, const std::string& name) {
  std::vector<std::string> values;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) continue;
    if (!absl::ConsumePrefix(&arg, name)) continue;
    if (absl::ConsumePrefix(&arg, "=")) {
      values.emplace_back(arg);
    } else if (arg.empty() && i + 1 < argc) {
      values.emplace_back(argv[++i]);
    }
  }
  return absl::StrJoin(values, ",");
}

// After main's one-time set-up; also where ranks forked by run_roles start.
int rank_main(int argc, char** argv) {
  bench::keep_freed_memory();
  bench::parse_flags(&argc, &argv, "benchmarks/ddp_rpc");
  // (Values from elsewhere, a --flagfile, stay when the command line has none.)
  if (std::string kill = every_value(argc, argv, "kill"); !kill.empty()) FLAGS_kill = kill;
  if (std::string add = every_value(argc, argv, "add"); !add.empty()) FLAGS_add = add;
  if (network_path()) {
    FLAGS_same_host_transport = false;
    FLAGS_same_host_allreduce = false;
  }
  check_flags();
  const Placement where = placement();
  return where.rank < 0 ? coordinator(argc, argv) : worker(where);
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "DDP + RPC hybrid benchmark (master + trainers + parameter servers), with PyTorch's own "
      "stack measured in the same run\n"
      "  all roles on this host:  ddp_rpc [--trainers=8 --ps=8 ...]\n"
      "  one role (multi-host):   ddp_rpc --rank=R --world_size=T+P+1 --master_addr=HOST "
      "--master_port=PORT [same flags on every rank]\n"
      "                           or RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the "
      "environment (torchrun style)");
  return bench::run_main(argc, argv, &rank_main);
}
