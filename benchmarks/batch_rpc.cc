// batch_rpc: batch RPC processing with async execution
// (PyTorch's batch-RPC tutorial), both halves:
//
// 1. Batch-updating parameter server. The PS's update_and_fetch_model
//    returns an rpc::Future (async execution): each trainer's call adds its
//    gradients and frees its callee thread; the last trainer to arrive runs
//    the optimizer step and completes the shared future, which answers every
//    pending call with the new model. Trainers train a small CNN on random
//    3x32x32 images (batch 20, 30 classes, MSE against one-hot labels).
//    Reported: model updates/s for each trainer count, and the PS's busy
//    callee threads (RpcAgent::busy_worker_threads, sampled every 1 ms),
//    next to a blocking variant that waits on the future inside the call.
// 2. Batch CartPole REINFORCE. One agent, world_size - 1 observers, each
//    stepping its own CartPole-v1 for --steps steps per episode and asking
//    the agent for every action: one at a time (select_action) or batched
//    (select_action_batch, async execution: the last observer to arrive runs
//    the policy once for everyone). Reported per world size: seconds for
//    --episodes episodes with and without batching (as the seed's main()),
//    and the episode rewards (first half vs second half).
//
//   ./bazelw run //benchmarks:batch_rpc -- [--mode=ps|cartpole|all] [--json=batch_rpc.json]
//
// Every configuration runs as fresh processes of this binary
// (benchmarks/harness.h); rank 0 (the PS or the agent) hands its figures
// back to the launcher. Requests and answers are counted on both sides.
#include <ATen/Parallel.h>
#include <gflags/gflags.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "benchmarks/batch_rpc_cartpole.h"
#include "benchmarks/batch_rpc_figures.h"
#include "benchmarks/batch_rpc_ps.h"
#include "benchmarks/common.h"
#include "benchmarks/harness.h"
#include "rpc/rpc.h"

DEFINE_string(mode, "all", "what to run: ps, cartpole or all");
DEFINE_string(trainers, "2,4,8", "PS: trainer counts, comma-separated (one run each)");
DEFINE_int32(iters, 30, "PS: measured iterations per trainer (one model update each)");
DEFINE_int32(warmup, 3, "PS: iterations before measuring");
DEFINE_double(ps_lr, 0.001, "PS: SGD learning rate (momentum 0.9)");
DEFINE_bool(blocking, true,
            "PS: also run update_and_fetch_model without async execution (the call waits on the "
            "future in its callee thread), for comparison");
DEFINE_string(world_sizes, "2..11",
              "CartPole: world sizes (agent + observers) as 'a..b' or comma-separated");
DEFINE_int32(episodes, 10, "CartPole: episodes per world size and mode");
DEFINE_int32(steps, 100, "CartPole: steps per observer per episode (the seed's NUM_STEPS)");
DEFINE_int32(seed, 543, "random seed (policy init, sampling, environments, data)");
DEFINE_double(gamma, 1.0, "CartPole: discount factor");
DEFINE_double(lr, 1e-2, "CartPole: Adam learning rate");
DEFINE_int32(num_worker_threads, 16, "RPC worker threads per process");
DEFINE_int32(timeout_s, 300, "wall-clock limit of each configuration's processes, in seconds");
DEFINE_int32(rpc_timeout_s, 60, "deadline of each RPC, in seconds (training and episodes get --timeout_s)");
DEFINE_string(json, "batch_rpc.json", "where to write the figures");
DEFINE_bool(pytorch, true,
            "also run PyTorch's side (benchmarks/reference/batch_rpc.py with --python: the "
            "tutorial's async_execution parameter server and batch CartPole with the same model, "
            "data sizes, trainer counts and world sizes) and print the ratios");
DEFINE_string(pytorch_script, "",
              "path of PyTorch's side (default: benchmarks/reference/batch_rpc.py from this "
              "binary's runfiles)");
DEFINE_string(task, "", "(internal) what a worker process runs: ps:<trainers> or cartpole:<world>");

namespace rpc = ddprpc::rpc;
namespace bench = ddprpc::benchmarks;
using ddprpc::benchmarks::batch_rpc::CartpoleRun;
using ddprpc::benchmarks::batch_rpc::Figures;
using ddprpc::benchmarks::batch_rpc::PsRun;
using ddprpc::benchmarks::batch_rpc::figures_from;
using ddprpc::benchmarks::batch_rpc::figures_json;
using ddprpc::benchmarks::batch_rpc::get;
using ddprpc::benchmarks::batch_rpc::kBatchSize;
using ddprpc::benchmarks::batch_rpc::kNumClasses;
using ddprpc::benchmarks::batch_rpc::observer_name;
using ddprpc::benchmarks::batch_rpc::run_cartpole;
using ddprpc::benchmarks::batch_rpc::run_ps;
using ddprpc::benchmarks::batch_rpc::trainer_name;

namespace {

// The runs' settings, from the flags.
PsRun ps_run() {
  PsRun run;
  run.warmup = FLAGS_warmup;
  run.iters = FLAGS_iters;
  run.lr = FLAGS_ps_lr;
  run.seed = FLAGS_seed;
  run.blocking = FLAGS_blocking;
  run.timeout = absl::Seconds(FLAGS_timeout_s);
  return run;
}

CartpoleRun cartpole_run() {
  CartpoleRun run;
  run.episodes = FLAGS_episodes;
  run.steps = FLAGS_steps;
  run.seed = FLAGS_seed;
  run.gamma = FLAGS_gamma;
  run.lr = FLAGS_lr;
  run.timeout = absl::Seconds(FLAGS_timeout_s);
  return run;
}

// Every configuration runs as fresh processes of this binary; rank 0 (the
// PS or the agent) runs it and hands its figures back.
int worker() {
  at::set_num_threads(1);  // many processes share the cores
  const int rank = bench::env_rank();
  std::vector<std::string> task = absl::StrSplit(FLAGS_task, ':');
  int n = 0;
  if (task.size() != 2 || !absl::SimpleAtoi(task[1], &n)) {
    std::fprintf(stderr, "batch_rpc: bad --task '%s'\n", FLAGS_task.c_str());
    return 2;
  }
  const bool ps = task[0] == "ps";
  const int world = ps ? n + 1 : n;
  rpc::RpcBackendOptions options = bench::backend_options();
  options.allow_insecure = bench::allow_insecure();
  options.num_worker_threads = FLAGS_num_worker_threads;
  options.rpc_timeout = absl::Seconds(FLAGS_rpc_timeout_s);
  const std::string name = rank == 0 ? (ps ? "ps" : "agent") : (ps ? trainer_name(rank - 1) : observer_name(rank));
  rpc::init_rpc(name, rank, world, options);
  int rc = 0;
  if (rank == 0) {
    try {
      std::string error;
      if (!bench::write_result(figures_json(ps ? run_ps(n, ps_run()) : run_cartpole(n, cartpole_run())), &error)) {
        throw std::runtime_error("cannot hand the figures back: " + error);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "batch_rpc: %s failed on %s: %s\n", FLAGS_task.c_str(), name.c_str(), e.what());
      rc = 1;
    }
  }
  rpc::shutdown(/*graceful=*/rc == 0);
  return rc;
}

// Runs one configuration as fresh processes; false on failure.
bool launch(const std::string& task, int nprocs, int argc, char** argv, Figures* out) {
  bench::RolesOptions launch;
  launch.nprocs = nprocs;
  launch.args = {"--task=" + task};
  launch.timeout = absl::Seconds(FLAGS_timeout_s);
  launch.grace_period = absl::Seconds(10);
  const bench::RolesResult r = bench::run_roles(argc, argv, launch);
  *out = figures_from(r.result);
  if (r.exit_code != 0) {
    std::fprintf(stderr, "batch_rpc: %s failed (rank %d): %s\n", task.c_str(), r.failed_rank,
                 r.message.c_str());
    return false;
  }
  if (!r.has_result) {
    std::fprintf(stderr, "batch_rpc: %s: %s\n", task.c_str(), r.result_error.c_str());
    return false;
  }
  return true;
}

bool parse_list(const std::string& s, std::vector<int>* out) {
  out->clear();
  std::vector<std::string> range = absl::StrSplit(s, "..");
  int a, b;
  if (range.size() == 2 && absl::SimpleAtoi(range[0], &a) && absl::SimpleAtoi(range[1], &b)) {
    for (int i = a; i <= b; ++i) out->push_back(i);
    return !out->empty();
  }
  for (const auto& part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    if (!absl::SimpleAtoi(part, &a)) return false;
    out->push_back(a);
  }
  return !out->empty();
}

double mean(const std::vector<double>& v, size_t begin, size_t end) {
  double s = 0;
  for (size_t i = begin; i < end; ++i) s += v[i];
  return end > begin ? s / static_cast<double>(end - begin) : 0;
}

// "first-half mean -> second-half mean" of episode rewards.
std::pair<double, double> halves(const std::vector<double>& r) {
  const size_t h = r.size() / 2;
  return {mean(r, 0, h), mean(r, h, r.size())};
}

std::string count_cell(double requests, double answers) {
  return absl::StrFormat("%.0f/%.0f", requests, answers);
}

// PyTorch's side, run with this run's configuration: its updates/s per
// trainer count, and its (batch, no-batch) seconds per world size.
struct PytorchFigures {
  std::map<int, double> updates_per_s;
  std::map<int, std::pair<double, double>> cartpole_s;
  bool ran = false;
};

PytorchFigures run_pytorch(const std::string& mode) {
  PytorchFigures out;
  const std::string script =
      bench::reference_script(FLAGS_pytorch_script, "benchmarks/reference/batch_rpc.py");
  if (!FLAGS_pytorch || script.empty()) {
    std::printf("\nPyTorch's side not run (--pytorch=false or reference script not found)\n");
    return out;
  }
  std::fprintf(stderr, "batch_rpc: running PyTorch's side (%s)\n", script.c_str());
  const bench::ReferenceRun run = bench::run_reference(
      script,
      {"--mode", mode, "--trainers", FLAGS_trainers, "--iters", absl::StrCat(FLAGS_iters),
       "--warmup", absl::StrCat(FLAGS_warmup), "--ps_lr", absl::StrCat(FLAGS_ps_lr),
       "--world_sizes", FLAGS_world_sizes, "--episodes", absl::StrCat(FLAGS_episodes), "--steps",
       absl::StrCat(FLAGS_steps), "--seed", absl::StrCat(FLAGS_seed), "--gamma",
       absl::StrCat(FLAGS_gamma), "--lr", absl::StrCat(FLAGS_lr), "--num_worker_threads",
       absl::StrCat(FLAGS_num_worker_threads), "--timeout_s", absl::StrCat(FLAGS_timeout_s)});
  if (!run.ok()) {
    std::printf("\nPyTorch's side failed (%s)\n", run.failure(1u << 20).c_str());
    return out;
  }
  const bench::JsonValue& doc = run.report;
  out.ran = true;
  if (const bench::JsonValue* ps = bench::json_at(doc, {"ps"})) {
    for (const auto& row : ps->list_value().values()) {
      out.updates_per_s[static_cast<int>(bench::json_number(row, {"trainers"}))] =
          bench::json_number(row, {"updates_per_s"});
    }
  }
  if (const bench::JsonValue* cp = bench::json_at(doc, {"cartpole"})) {
    for (const auto& row : cp->list_value().values()) {
      out.cartpole_s[static_cast<int>(bench::json_number(row, {"world_size"}))] = {
          bench::json_number(row, {"batch_s"}), bench::json_number(row, {"nobatch_s"})};
    }
  }
  return out;
}

int coordinator(int argc, char** argv) {
  std::vector<int> trainer_counts, world_sizes;
  const bool do_ps = FLAGS_mode == "ps" || FLAGS_mode == "all";
  const bool do_cartpole = FLAGS_mode == "cartpole" || FLAGS_mode == "all";
  if (!do_ps && !do_cartpole) {
    std::fprintf(stderr, "batch_rpc: --mode must be ps, cartpole or all\n");
    return 2;
  }
  if ((do_ps && !parse_list(FLAGS_trainers, &trainer_counts)) ||
      (do_cartpole && !parse_list(FLAGS_world_sizes, &world_sizes))) {
    std::fprintf(stderr, "batch_rpc: bad --trainers or --world_sizes\n");
    return 2;
  }
  if (std::any_of(trainer_counts.begin(), trainer_counts.end(), [](int t) { return t < 1; }) ||
      std::any_of(world_sizes.begin(), world_sizes.end(), [](int w) { return w < 2; })) {
    std::fprintf(stderr, "batch_rpc: --trainers must be >= 1 and --world_sizes >= 2\n");
    return 2;
  }
  if (FLAGS_iters < 1 || FLAGS_warmup < 1 || FLAGS_episodes < 1 || FLAGS_steps < 1) {
    std::fprintf(stderr, "batch_rpc: --iters, --warmup, --episodes and --steps must be >= 1\n");
    return 2;
  }
  std::printf("batch_rpc: %d CPUs, seed %d, %d RPC worker threads per process\n", bench::cpu_count(),
              FLAGS_seed, FLAGS_num_worker_threads);
  std::printf("batch_rpc: %s\n", bench::versions().c_str());
  bench::Json json;
  json.begin_object();
  json.key("config").begin_object();
  json.key("cpus").value(bench::cpu_count()).key("seed").value(FLAGS_seed);
  json.versions();
  json.key("num_worker_threads").value(FLAGS_num_worker_threads);
  json.key("ps_iters").value(FLAGS_iters).key("ps_warmup").value(FLAGS_warmup);
  json.key("ps_lr").value(FLAGS_ps_lr).key("episodes").value(FLAGS_episodes);
  json.key("steps").value(FLAGS_steps).key("gamma").value(FLAGS_gamma).key("lr").value(FLAGS_lr);
  json.end_object();
  bool ok = true;
  std::map<int, double> our_updates_per_s;                   // async execution
  std::map<int, std::pair<double, double>> our_cartpole_s;  // batch, no-batch

  if (do_ps) {
    std::printf("\nBatch-updating parameter server: small CNN (3x32x32, batch %lld, %lld classes), "
                "%d measured + %d warm-up iterations per trainer\n",
                static_cast<long long>(kBatchSize), static_cast<long long>(kNumClasses), FLAGS_iters,
                FLAGS_warmup);
    std::fflush(stdout);
    bench::Table table({"trainers", "update_and_fetch_model", "updates/s", "grads/s",
                        "blocked at update mean", "max", "busy sampled mean", "max",
                        "requests/answers"});
    json.key("ps").begin_array();
    for (int t : trainer_counts) {
      Figures f;
      std::fprintf(stderr, "batch_rpc: parameter server with %d trainers\n", t);
      if (!launch(absl::StrCat("ps:", t), t + 1, argc, argv, &f)) {
        ok = false;
        continue;
      }
      for (const char* mode : {"async", "blocking"}) {
        const std::string tag = std::string(mode) + ".";
        if (!f.count(tag + "updates")) continue;
        const double ups = get(f, tag + "updates_per_s");
        if (std::string(mode) == "async") our_updates_per_s[t] = ups;
        table.add({absl::StrCat(t), std::string(mode) == "async" ? "async execution" : "blocking",
                   absl::StrFormat("%.1f", ups), absl::StrFormat("%.1f", ups * t),
                   absl::StrFormat("%.2f", get(f, tag + "blocked_mean")),
                   absl::StrFormat("%.0f", get(f, tag + "blocked_max")),
                   absl::StrFormat("%.2f", get(f, tag + "busy_mean")),
                   absl::StrFormat("%.0f", get(f, tag + "busy_max")),
                   count_cell(get(f, tag + "requests"), get(f, tag + "answers"))});
        json.begin_object();
        json.key("trainers").value(t).key("mode").value(mode);
        json.key("updates_per_s").value(ups).key("grads_per_s").value(ups * t);
        json.key("updates").value(get(f, tag + "updates"));
        json.key("blocked_threads_at_update_mean").value(get(f, tag + "blocked_mean"));
        json.key("blocked_threads_at_update_max").value(get(f, tag + "blocked_max"));
        json.key("busy_threads_max").value(get(f, tag + "busy_max"));
        json.key("busy_threads_mean").value(get(f, tag + "busy_mean"));
        json.key("busy_samples").value(get(f, tag + "busy_samples"));
        json.key("max_parked_requests").value(get(f, tag + "max_parked_requests"));
        json.key("requests").value(get(f, tag + "requests"));
        json.key("answers").value(get(f, tag + "answers"));
        json.key("models_received").value(get(f, tag + "received"));
        json.key("expected").value(get(f, tag + "expected"));
        json.end_object();
      }
    }
    json.end_array();
    std::printf("%s", table.str().c_str());
    std::printf("blocked at update: callee threads the other trainers' calls held on the PS when the "
                "last one arrived\n(should stay near 0 with async execution); busy sampled: "
                "RpcAgent::busy_worker_threads() every 1 ms\n");
    std::fflush(stdout);
  }

  if (do_cartpole) {
    std::printf("\nBatch CartPole REINFORCE: %d episodes x %d steps per observer, seed %d\n",
                FLAGS_episodes, FLAGS_steps, FLAGS_seed);
    std::fflush(stdout);
    bench::Table table({"world size", "batch s", "no-batch s", "speedup", "batch reward",
                        "no-batch reward", "batch req/ans", "no-batch req/ans"});
    std::string csv;
    json.key("cartpole").begin_array();
    for (int w : world_sizes) {
      Figures f;
      std::fprintf(stderr, "batch_rpc: CartPole with world size %d\n", w);
      if (!launch(absl::StrCat("cartpole:", w), w, argc, argv, &f) || !f.count("batch.seconds") ||
          !f.count("nobatch.seconds")) {
        ok = false;
        continue;
      }
      const double b = get(f, "batch.seconds"), nb = get(f, "nobatch.seconds");
      our_cartpole_s[w] = {b, nb};
      auto [b0, b1] = halves(f["batch.rewards"]);
      auto [n0, n1] = halves(f["nobatch.rewards"]);
      table.add({absl::StrCat(w), absl::StrFormat("%.3f", b), absl::StrFormat("%.3f", nb),
                 absl::StrFormat("%.2fx", b > 0 ? nb / b : 0), absl::StrFormat("%.1f -> %.1f", b0, b1),
                 absl::StrFormat("%.1f -> %.1f", n0, n1),
                 count_cell(get(f, "batch.requests"), get(f, "batch.answers")),
                 count_cell(get(f, "nobatch.requests"), get(f, "nobatch.answers"))});
      absl::StrAppendFormat(&csv, "%d, %.4f, %.4f\n", w, b, nb);
      json.begin_object();
      json.key("world_size").value(w);
      for (const char* mode : {"batch", "nobatch"}) {
        const std::string tag = std::string(mode) + ".";
        json.key(mode).begin_object();
        json.key("seconds").value(get(f, tag + "seconds"));
        for (const char* series : {"rewards", "running_rewards"}) {
          json.key(series).begin_array();
          for (double v : f[tag + series]) json.value(v);
          json.end_array();
        }
        for (const char* count : {"requests", "answers", "actions_received", "expected"}) {
          json.key(count).value(get(f, tag + count));
        }
        json.end_object();
      }
      json.end_object();
    }
    json.end_array();
    std::printf("%s", table.str().c_str());
    std::printf("reward: mean first-episode length (capped at --steps), first half of the episodes "
                "-> second half\nworld_size, batch seconds, no-batch seconds (the seed's output):\n%s",
                csv.c_str());
  }
  const PytorchFigures theirs = run_pytorch(FLAGS_mode);
  if (theirs.ran) {
    std::printf("\n------------------ PyTorch (same machine, same run) ---------------------\n");
    json.key("pytorch").begin_object();
    if (do_ps) {
      std::printf("Parameter server, async execution on both sides (@rpc.functions.async_execution):\n");
      bench::Table table({"trainers", "ddprpc updates/s", "PyTorch updates/s", "ddprpc vs PyTorch"});
      json.key("ps").begin_array();
      for (int t : trainer_counts) {
        const double ours = our_updates_per_s.count(t) ? our_updates_per_s[t] : 0;
        const double pt = theirs.updates_per_s.count(t) ? theirs.updates_per_s.at(t) : 0;
        table.add({absl::StrCat(t), absl::StrFormat("%.1f", ours), absl::StrFormat("%.1f", pt),
                   bench::speedup_cell(ours, pt, true)});
        json.begin_object().key("trainers").value(t).key("updates_per_s").value(pt);
        json.key("ddprpc_vs_pytorch").value(ours > 0 && pt > 0 ? ours / pt : 0.0).end_object();
      }
      json.end_array();
      std::printf("%s", table.str().c_str());
    }
    if (do_cartpole) {
      std::printf("CartPole, seconds for %d episodes (lower is better; ratio = PyTorch s / ddprpc s):\n",
                  FLAGS_episodes);
      bench::Table table({"world size", "ddprpc batch s", "PyTorch batch s", "ratio",
                          "ddprpc no-batch s", "PyTorch no-batch s", "ratio"});
      json.key("cartpole").begin_array();
      for (int w : world_sizes) {
        const auto ours = our_cartpole_s.count(w) ? our_cartpole_s[w] : std::make_pair(0.0, 0.0);
        const auto pt = theirs.cartpole_s.count(w) ? theirs.cartpole_s.at(w) : std::make_pair(0.0, 0.0);
        table.add({absl::StrCat(w), absl::StrFormat("%.3f", ours.first),
                   absl::StrFormat("%.3f", pt.first), bench::speedup_cell(ours.first, pt.first, false),
                   absl::StrFormat("%.3f", ours.second), absl::StrFormat("%.3f", pt.second),
                   bench::speedup_cell(ours.second, pt.second, false)});
        json.begin_object().key("world_size").value(w);
        json.key("batch_s").value(pt.first).key("nobatch_s").value(pt.second).end_object();
      }
      json.end_array();
      std::printf("%s", table.str().c_str());
    }
    json.end_object();
  }
  json.end_object();
  const std::string path = bench::output_path(FLAGS_json);
  if (json.write(path)) std::printf("wrote %s\n", path.c_str());
  return ok ? 0 : 1;
}

}  // namespace

// After main's one-time set-up; also where ranks forked by run_roles start.
int rank_main(int argc, char** argv) {
  bench::keep_freed_memory();
  bench::parse_flags(&argc, &argv, "benchmarks/batch_rpc");
  if (bench::env_rank() >= 0) return worker();
  return coordinator(argc, argv);
}

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "batch RPC with async execution: a batch-updating parameter server and batch CartPole "
      "REINFORCE\n  usage: batch_rpc [--mode=ps|cartpole|all] [--trainers=2,4,8] "
      "[--world_sizes=2..11] [--json=batch_rpc.json]");
  return bench::run_main(argc, argv, &rank_main);
}
