// HybridModel training across an RPC world, as a library: the master,
// parameter-server and trainer roles of the DDP + RPC benchmark, configured
// by HybridTrainerOptions, returning typed results.
//
// World (HybridWorld): trainers 0..T-1 ("trainer<r>"), parameter servers
// T..T+P-1 ("ps<i>"), master T+P ("master"). Each process joins the world
// itself (rpc::init_rpc under HybridWorld::name, rpc::shutdown at the end)
// and in between plays its role:
//   - parameter server: nothing to call; the master creates its table there;
//   - trainer: keeps a HybridTrainerService (same options as the master)
//     alive from before rpc::init_rpc until after rpc::shutdown;
//   - master: run_hybrid_training(options) trains on every trainer at once
//     and returns each one's per-iteration seconds, examples and losses, or
//     throws HybridTrainingError naming every trainer that failed.
// A trainer builds a HybridModel over the tables, averages its dense stack
// across the trainers with DDP (a process group rendezvousing through the
// world's store) and runs warmup + iters iterations of batches_per_iter
// batches (make_batches), each in a dist_autograd context: forward, cross
// entropy, dist_autograd::backward, DistributedOptimizer SGD step. The
// initial tables, dense stack and data follow from `seed` alone: the master
// seeds each parameter server, and each trainer seeds itself, with
// derived_seed(seed, rank) before building their parameters. Runs may
// follow one another in the same world.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "models/linear.h"

namespace ddprpc::models {

// Outputs of the dense stack: the classes a bag is labelled with.
constexpr int64_t kHybridClasses = 8;

enum class CollectiveBackend {
  kGloo,  // CPU
  kNccl,  // GPU; needs a CUDA build and ddp::nccl_available()
};

struct HybridTrainerOptions {
  int trainers = 8;
  int ps = 8;                    // one EmbeddingBag table each
  int64_t num_embeddings = 300;  // rows of each table
  int64_t embedding_dim = 64;    // columns; the dense stack takes ps * embedding_dim
  int iters = 100;               // measured iterations per trainer
  int warmup = 5;                // iterations before measuring
  int batches_per_iter = 10;
  double lr = 0.05;  // SGD, on every parameter
  uint64_t seed = 1;
  // Learnable targets (make_batches) instead of random ones.
  bool learnable_target = false;
  // Sparse (COO) table gradients: a step updates only the rows looked up.
  bool sparse = false;
  // Tables looked up one after another (rpc_sync each) instead of all at once.
  bool sequential_lookups = false;
  DenseKernel dense_kernel = DenseKernel::kXnnpack;
  CollectiveBackend backend = CollectiveBackend::kGloo;
  // Deadline of a trainer's whole run: the master's call to it and the
  // trainers' rendezvous.
  absl::Duration run_timeout = absl::Minutes(30);
  // Deadline of each collective among the trainers.
  absl::Duration collective_timeout = absl::Seconds(60);
  // The trainers' group (ddp::ProcessGroupOptions): the same-host
  // allreduce, and how long its barriers spin before they sleep.
  bool same_host_allreduce = true;
  absl::Duration max_spin = absl::ZeroDuration();
  // Elastic runs (docs/elastic.md): the run keeps a membership of the
  // world in the store, and the trainers average over an
  // elastic::ElasticGroup of its trainers.
  //   - A trainer lost in the middle of the run is dropped: the batch in
  //     flight is dropped on every survivor, the survivors form the next
  //     epoch's group (DDP broadcasting rank 0's dense stack) and train on,
  //     and the master reports the lost trainer instead of failing.
  //   - A parameter server lost is replaced: the master restores each of
  //     its shards on a surviving server from the shard's newest checkpoint,
  //     the trainers re-bind their tables and optimizer to it and train on
  //     (each drops the batch its call to the lost server failed in), and
  //     the master reports the optimizer steps the checkpoint lacked.
  bool elastic = false;
  // Elastic runs: every `checkpoint_every` iterations (and once before the
  // first) each shard is copied, between optimizer steps, to where it
  // survives its server: in the memory of the next surviving server
  // (replicate_checkpoints) and to a file under the servers' own
  // checkpoint directory (HybridServerService), where they have one. 0:
  // only the first.
  int checkpoint_every = 10;
  bool replicate_checkpoints = true;
  // Injected faults: trainer<index> ends its process at once (status 0, no
  // cleanup, as a crash would end it) when it starts iteration `iteration`
  // (0-based, warm-up included); ps<index> ends its own when the trainers'
  // rank 0 starts that iteration (it tells it to).
  enum class Role { kTrainer, kPs };
  struct Kill {
    int index = 0;
    int iteration = 0;
    Role role = Role::kTrainer;
  };
  std::vector<Kill> kills;
  // Elastic runs: standby trainers, one per entry. trainer<trainers + j>
  // is in the RPC world from the start (a process of the job, holding its
  // secret) but not in the membership; when the trainers' rank 0 starts
  // iteration adds[j].iteration it asks to join, is admitted at the first
  // iteration start after it asked, gets the dense stack from the trainers' rank 0 and
  // trains from that boundary on. A standby the run ends without is
  // reported as never joined.
  struct Add {
    int iteration = 0;
  };
  std::vector<Add> adds;
  // Master only: fetch every table's weight before and after training.
  bool fetch_tables = false;
  // Master only: have each trainer return its dense parameters.
  bool return_dense_parameters = false;

  // What a trainer does, as text (sizes, iterations, lr, seed, target,
  // backend, lookups, kernel, sparse): a trainer whose own differs from the
  // master's refuses to train.
  std::string workload() const;
  // Why these options cannot run, or "" when they can.
  std::string invalid() const;
};

// Ranks and names of the processes of a world.
class HybridWorld {
 public:
  HybridWorld(int trainers, int ps) : trainers_(trainers), ps_(ps) {}
  // Standby trainers (adds) are trainers of the world.
  explicit HybridWorld(const HybridTrainerOptions& o)
      : HybridWorld(o.trainers + static_cast<int>(o.adds.size()), o.ps) {}
  int trainers() const { return trainers_; }
  int ps() const { return ps_; }
  int size() const { return trainers_ + ps_ + 1; }
  int master_rank() const { return trainers_ + ps_; }
  bool is_trainer(int rank) const { return rank >= 0 && rank < trainers_; }
  bool is_ps(int rank) const { return rank >= trainers_ && rank < trainers_ + ps_; }
  bool is_master(int rank) const { return rank == master_rank(); }
  // "trainer<r>", "ps<i>" or "master".
  std::string name(int rank) const;

 private:
  const int trainers_;
  const int ps_;
};

// The seed of rank `rank`'s data and initial parameters: the same (seed,
// rank) always gives the same stream, different ranks unrelated ones.
uint64_t derived_seed(uint64_t seed, int rank);

struct HybridBatch {
  at::Tensor indices, offsets, targets;  // int64; one target per bag
};

// One iteration's batches, drawn from `rng`: each has 20..50 indices in
// [0, num_embeddings) cut into bags by offsets with random steps 1..10, and
// one target in [0, kHybridClasses) per bag. Targets are random (nothing to
// learn) or, with learnable_target, every index of a bag is a row of its
// target class (index % kHybridClasses == target).
std::vector<HybridBatch> make_batches(const HybridTrainerOptions& options, std::mt19937_64& rng);

// What a trainer reports: once with iteration 0 when training starts (its
// group and optimizer built), then after every iteration.
struct TrainerProgress {
  int rank = 0;
  int iteration = 0;  // iterations done
  int total = 0;      // warmup + iters
  bool measured = false;
  double seconds = 0;  // of this iteration
  int64_t examples = 0;
  double mean_loss = 0;  // over this iteration's batches
};

// Parameter-server ranks (optional): where this server keeps checkpoint
// files of the shards it holds (elastic runs). Without one, or with an
// empty directory, a server keeps no files, and a shard lost with its
// server is restored from a replica only.
struct HybridServerOptions {
  // A directory shared by every server (the job's files go under
  // "<checkpoint_dir>/<job>/", shard_checkpoint.h), or "".
  std::string checkpoint_dir;
  // Whether a job member may end this server's process (ddp_rpc
  // --kill=psN@iterK asks the trainers' rank 0 to); off, such a call fails.
  bool accept_injected_faults = false;
};

// While one lives, this process's parameter server keeps `options`. At most
// one per process.
class HybridServerService {
 public:
  explicit HybridServerService(HybridServerOptions options);
  ~HybridServerService();
  HybridServerService(const HybridServerService&) = delete;
  HybridServerService& operator=(const HybridServerService&) = delete;
};

// Trainer ranks: while one lives, this process trains when a master's
// run_hybrid_training reaches it. At most one per process.
class HybridTrainerService {
 public:
  using ProgressCallback = std::function<void(const TrainerProgress&)>;
  // `on_progress` runs on the training thread.
  explicit HybridTrainerService(HybridTrainerOptions options, ProgressCallback on_progress = {});
  ~HybridTrainerService();
  HybridTrainerService(const HybridTrainerService&) = delete;
  HybridTrainerService& operator=(const HybridTrainerService&) = delete;
};

struct TrainerResult {
  std::vector<double> seconds;    // per measured iteration
  std::vector<int64_t> examples;  // per measured iteration (bags)
  std::vector<double> losses;     // per iteration, warm-up first: mean loss of its batches
  // Mean milliseconds per measured batch in each phase.
  double forward_ms = 0, backward_ms = 0, step_ms = 0, release_ms = 0;
  // Flattened, after training (return_dense_parameters); else undefined.
  at::Tensor dense_parameters;
  // Elastic runs: the trainer was lost (its timings are empty), and why.
  bool lost = false;
  std::string lost_reason;
  // Elastic runs: batches dropped because a trainer was lost in them, and
  // the membership epoch the trainer ended in.
  int dropped_batches = 0;
  int64_t epoch = 1;
  // Elastic runs: seconds from the start of each dropped batch, or of the
  // failed collective at an iteration's start (about when a worker was
  // lost), to the end of the next batch completed.
  std::vector<double> recovery_s;
  // Elastic runs: the iteration a standby trainer joined at (its seconds
  // and examples are of the measured iterations from there on), 0 for the
  // others; a standby the run ended without has `joined` false.
  int first_iteration = 0;
  bool joined = true;
};

// Elastic runs: a shard restored after its server was lost.
struct ShardRestore {
  int shard = 0;
  std::string lost_server;  // "ps<i>"
  std::string restored_on;  // the surviving server that holds it now
  std::string source;       // "replica" or "file"
  int64_t epoch = 0;        // the membership epoch it was restored for
  int64_t checkpoint_iteration = 0;
  // Optimizer steps the surviving shards had applied that the checkpoint
  // lacks: the updates lost, counted when the shard was restored.
  int64_t updates_lost = 0;
  double seconds = 0;  // from the master seeing the loss to the restore
};

struct HybridRunResult {
  std::vector<TrainerResult> trainers;  // by rank
  // From the tables' creation until every trainer returned.
  double wall_s = 0;
  // Each table's weight (fetch_tables); else empty.
  std::vector<at::Tensor> tables_before, tables_after;
  // Elastic runs: the membership's epoch at the end (1: nobody was lost)
  // and the trainers lost, by rank.
  int64_t epoch = 1;
  std::vector<int> lost_trainers;
  // Elastic runs: each shard restored, in order, and the checkpoints taken
  // (each of every shard).
  std::vector<ShardRestore> restores;
  int64_t checkpoints = 0;
};

// Training failed on some trainers.
class HybridTrainingError : public std::runtime_error {
 public:
  struct Failure {
    int trainer;
    std::string message;
  };
  explicit HybridTrainingError(std::vector<Failure> failures);
  // Every failure, in rank order (the first may only be a symptom of a later
  // one, e.g. an allreduce broken because another trainer stopped).
  const std::vector<Failure>& failures() const { return failures_; }

 private:
  const std::vector<Failure> failures_;
};

// Master: one run (see above). Throws std::invalid_argument for options
// that cannot run, HybridTrainingError when a trainer fails (in an elastic
// run: when a trainer that is still a member fails, or none is left), and
// rpc errors when a parameter server cannot be reached.
HybridRunResult run_hybrid_training(const HybridTrainerOptions& options);

}  // namespace ddprpc::models
