#include "models/hybrid_trainer.h"

#include <ATen/Context.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <tuple>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "autograd/dist_autograd.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/process_group.h"
#include "models/hybrid_model.h"
#include "optim/distributed_optimizer.h"
#include "rpc/rendezvous/store.h"
#include "rpc/rpc.h"
#include "rpc/rref/rref.h"

namespace ddprpc::models {
namespace {

constexpr char kTrainFunction[] = "ddprpc.models.hybrid_trainer.train";
constexpr char kSeedFunction[] = "ddprpc.models.hybrid_trainer.seed";

// What a trainer sends back: seconds, examples, mean ms per phase (forward,
// backward, step, release), losses, flattened dense parameters (empty when
// not asked for).
using TrainerReply = std::tuple<std::vector<double>, std::vector<int64_t>, std::vector<double>,
                                std::vector<double>, at::Tensor>;

// The options and callback of this process's HybridTrainerService.
struct Served {
  const HybridTrainerOptions options;
  const HybridTrainerService::ProgressCallback on_progress;
};

absl::Mutex served_mu;
std::shared_ptr<const Served> served ABSL_GUARDED_BY(served_mu);

std::shared_ptr<const Served> current_service() {
  absl::MutexLock lock(&served_mu);
  return served;
}

std::pair<std::string, int> split_host_port(const std::string& address) {
  const size_t colon = address.rfind(':');
  return {address.substr(0, colon), std::stoi(address.substr(colon + 1))};
}

const char* backend_name(CollectiveBackend backend) {
  return backend == CollectiveBackend::kNccl ? "nccl" : "gloo";
}

// Runs on trainer `rank`, called by the master: run `run` of the world,
// over `tables`.
TrainerReply train(std::vector<rpc::RRef<EmbeddingTable>> tables, int64_t rank, int64_t run,
                   std::string master_workload, bool return_dense) {
  const std::shared_ptr<const Served> service = current_service();
  if (service == nullptr) {
    throw std::runtime_error(absl::StrCat("trainer", rank, " serves no hybrid training"));
  }
  const HybridTrainerOptions& o = service->options;
  if (master_workload != o.workload()) {
    throw std::invalid_argument(absl::StrCat("trainer", rank, " was started with other options (",
                                             o.workload(), ") than the master (",
                                             master_workload, ")"));
  }
  std::mt19937_64 rng(derived_seed(o.seed, static_cast<int>(rank)));
  at::manual_seed(derived_seed(o.seed, static_cast<int>(rank)));  // the dense stack's initial values
  HybridModelOptions model_options;
  model_options.lookups = o.sequential_lookups ? HybridModelOptions::Lookups::kSequential
                                               : HybridModelOptions::Lookups::kConcurrent;
  model_options.dense_kernel = o.dense_kernel;
  model_options.sparse = o.sparse;
  HybridModel model(std::move(tables), o.embedding_dim, model_options);
  // DDP among the trainers (rendezvous through the RPC store): the same
  // initial dense parameters everywhere, gradients averaged inside every
  // dist_autograd backward pass.
  auto agent = rpc::current_agent();
  const auto [store_host, store_port] = split_host_port(agent->store().address());
  auto store = std::make_shared<rpc::Store>(store_host, store_port, o.run_timeout);
  ddp::ProcessGroupOptions group_options;
  group_options.listen_address = split_host_port(agent->self().address).first;
  // A collective waiting on a stopped or unreachable trainer fails like an RPC would.
  group_options.timeout = o.collective_timeout;
  group_options.same_host_allreduce = o.same_host_allreduce;
  group_options.max_spin = o.max_spin;
  auto make_group = o.backend == CollectiveBackend::kNccl ? ddp::make_nccl_group
                                                          : ddp::make_gloo_group;
  auto group = make_group(store, absl::StrCat("ddp/trainers/", run, "/"), static_cast<int>(rank),
                          o.trainers, group_options);
  ddp::DdpOptions ddp_options;
  ddp_options.timeout = o.collective_timeout;
  ddp::DistributedDataParallel ddp(model.dense().ptr(), group, ddp_options);
  optim::DistributedOptimizer optimizer("sgd", {{"lr", o.lr}}, model.parameter_rrefs());

  std::vector<double> seconds, losses;
  std::vector<int64_t> examples;
  std::vector<double> phase_ms(4, 0.0);  // forward, backward, step, release
  int64_t measured_batches = 0;
  const int total = o.iters + o.warmup;
  TrainerProgress progress;
  progress.rank = static_cast<int>(rank);
  progress.total = total;
  if (service->on_progress) service->on_progress(progress);
  for (int it = 0; it < total; ++it) {
    const bool measured = it >= o.warmup;
    const absl::Time start = absl::Now();
    int64_t n = 0;
    double loss_sum = 0;
    for (const HybridBatch& b : make_batches(o, rng)) {
      n += b.targets.size(0);
      absl::Time t[5];
      {
        t[0] = absl::Now();
        dist_autograd::Context context;
        at::Tensor loss = at::cross_entropy_loss(model.forward(b.indices, b.offsets), b.targets);
        loss_sum += loss.item<double>();
        t[1] = absl::Now();
        dist_autograd::backward(context.id(), {loss});
        t[2] = absl::Now();
        optimizer.step(context.id());
        t[3] = absl::Now();
      }
      t[4] = absl::Now();
      if (measured) {
        for (int i = 0; i < 4; ++i) phase_ms[i] += absl::ToDoubleMilliseconds(t[i + 1] - t[i]);
        ++measured_batches;
      }
    }
    const double took = absl::ToDoubleSeconds(absl::Now() - start);
    if (measured) {
      seconds.push_back(took);
      examples.push_back(n);
    }
    losses.push_back(loss_sum / o.batches_per_iter);
    if (service->on_progress) {
      progress.iteration = it + 1;
      progress.measured = measured;
      progress.seconds = took;
      progress.examples = n;
      progress.mean_loss = losses.back();
      service->on_progress(progress);
    }
  }
  for (double& ms : phase_ms) ms /= std::max<int64_t>(1, measured_batches);
  at::Tensor dense = at::empty({0});
  if (return_dense) {
    std::vector<at::Tensor> flat;
    for (const auto& p : model.dense()->parameters()) flat.push_back(p.detach().reshape({-1}));
    dense = at::cat(flat).clone();
  }
  return {seconds, examples, phase_ms, losses, dense};
}
DDPRPC_REGISTER_FUNCTION_AS(hybrid_trainer_train, kTrainFunction, &train);

// Runs on a parameter server before the master creates its table there.
void seed(int64_t value) { at::manual_seed(static_cast<uint64_t>(value)); }
DDPRPC_REGISTER_FUNCTION_AS(hybrid_trainer_seed, kSeedFunction, &seed);

// A copy of every table's weight, fetched from its parameter server.
std::vector<at::Tensor> fetch_weights(const std::vector<rpc::RRef<EmbeddingTable>>& tables) {
  std::vector<at::Tensor> out;
  for (const auto& table : tables) {
    out.push_back(table.rpc_sync(&EmbeddingTable::parameter_rrefs).at(0).to_here());
  }
  return out;
}

std::string describe(const std::vector<HybridTrainingError::Failure>& failures) {
  std::string out = "training failed on";
  for (const auto& f : failures) absl::StrAppend(&out, " trainer", f.trainer, " (", f.message, ")");
  return out;
}

}  // namespace

std::string HybridTrainerOptions::workload() const {
  return absl::StrFormat(
      "trainers=%d ps=%d num_embeddings=%d embedding_dim=%d iters=%d warmup=%d "
      "batches_per_iter=%d lr=%g seed=%d learnable_target=%d backend=%s lookups=%s "
      "dense_kernel=%s sparse=%d",
      trainers, ps, num_embeddings, embedding_dim, iters, warmup, batches_per_iter, lr, seed,
      learnable_target, backend_name(backend), sequential_lookups ? "sequential" : "concurrent",
      dense_kernel_name(dense_kernel), sparse);
}

std::string HybridTrainerOptions::invalid() const {
  if (trainers < 1 || ps < 1 || iters < 1 || batches_per_iter < 1) {
    return "trainers, ps, iters and batches_per_iter must be at least 1";
  }
  if (warmup < 0 || embedding_dim < 1 || num_embeddings < 1) {
    return "warmup must be at least 0, embedding_dim and num_embeddings at least 1";
  }
  if (learnable_target && num_embeddings < kHybridClasses) {
    return "a learnable target needs num_embeddings of at least 8 (a row per class)";
  }
  return "";
}

std::string HybridWorld::name(int rank) const {
  if (is_trainer(rank)) return absl::StrCat("trainer", rank);
  if (is_ps(rank)) return absl::StrCat("ps", rank - trainers_);
  return "master";
}

uint64_t derived_seed(uint64_t seed, int rank) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(rank)};
  uint32_t words[2];
  seq.generate(words, words + 2);
  return (uint64_t{words[0]} << 32) | words[1];
}

std::vector<HybridBatch> make_batches(const HybridTrainerOptions& options, std::mt19937_64& rng) {
  auto uniform = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const int64_t rows = options.num_embeddings;
  std::vector<HybridBatch> out;
  for (int b = 0; b < options.batches_per_iter; ++b) {
    const int64_t k = uniform(20, 50);
    std::vector<int64_t> offsets;
    for (int64_t s = 0; s < k; s += uniform(1, 10)) offsets.push_back(s);
    std::vector<int64_t> indices(k), targets(offsets.size());
    for (size_t bag = 0; bag < offsets.size(); ++bag) {
      const int64_t target = uniform(0, kHybridClasses - 1);
      targets[bag] = target;
      const int64_t end = bag + 1 < offsets.size() ? offsets[bag + 1] : k;
      for (int64_t i = offsets[bag]; i < end; ++i) {
        indices[i] = options.learnable_target
                         ? target + kHybridClasses * uniform(0, (rows - 1 - target) / kHybridClasses)
                         : uniform(0, rows - 1);
      }
    }
    out.push_back({at::tensor(indices, at::kLong), at::tensor(offsets, at::kLong),
                   at::tensor(targets, at::kLong)});
  }
  return out;
}

HybridTrainerService::HybridTrainerService(HybridTrainerOptions options,
                                           ProgressCallback on_progress) {
  auto service = std::make_shared<const Served>(Served{std::move(options), std::move(on_progress)});
  absl::MutexLock lock(&served_mu);
  if (served != nullptr) throw std::logic_error("a HybridTrainerService already runs in this process");
  served = std::move(service);
}

HybridTrainerService::~HybridTrainerService() {
  absl::MutexLock lock(&served_mu);
  served.reset();
}

HybridTrainingError::HybridTrainingError(std::vector<Failure> failures)
    : std::runtime_error(describe(failures)), failures_(std::move(failures)) {}

HybridRunResult run_hybrid_training(const HybridTrainerOptions& options) {
  const std::string why = options.invalid();
  if (!why.empty()) throw std::invalid_argument("run_hybrid_training: " + why);
  static std::atomic<int64_t> runs{0};  // each run's process group has its own keys
  const int64_t run = runs.fetch_add(1);
  const HybridWorld world(options);
  {
    std::vector<rpc::Future<void>> seeded;
    for (int i = 0; i < world.ps(); ++i) {
      const int rank = world.trainers() + i;
      seeded.push_back(rpc::rpc_async<void>(world.name(rank), kSeedFunction,
                                            static_cast<int64_t>(derived_seed(options.seed, rank))));
    }
    rpc::wait_all(seeded);
  }
  const absl::Time start = absl::Now();
  std::vector<rpc::RRef<EmbeddingTable>> tables;
  for (int i = 0; i < world.ps(); ++i) {
    tables.push_back(rpc::remote<EmbeddingTable>(world.name(world.trainers() + i),
                                                 options.num_embeddings, options.embedding_dim));
  }
  HybridRunResult result;
  if (options.fetch_tables) result.tables_before = fetch_weights(tables);
  std::vector<rpc::Future<TrainerReply>> runs_on;
  for (int r = 0; r < world.trainers(); ++r) {
    runs_on.push_back(rpc::rpc_async<TrainerReply>(
        rpc::CallOptions{options.run_timeout}, world.name(r), kTrainFunction, tables, int64_t{r},
        run, options.workload(), options.return_dense_parameters));
  }
  rpc::collect_all(runs_on).wait();
  std::vector<HybridTrainingError::Failure> failures;
  for (int r = 0; r < world.trainers(); ++r) {
    if (runs_on[r].has_error()) {
      failures.push_back({r, runs_on[r].error_message()});
      continue;
    }
    auto [seconds, examples, phase_ms, losses, dense] = runs_on[r].value();
    TrainerResult t;
    t.seconds = std::move(seconds);
    t.examples = std::move(examples);
    t.losses = std::move(losses);
    t.forward_ms = phase_ms.at(0);
    t.backward_ms = phase_ms.at(1);
    t.step_ms = phase_ms.at(2);
    t.release_ms = phase_ms.at(3);
    if (options.return_dense_parameters) t.dense_parameters = dense;
    result.trainers.push_back(std::move(t));
  }
  if (!failures.empty()) throw HybridTrainingError(std::move(failures));
  result.wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  if (options.fetch_tables) result.tables_after = fetch_weights(tables);
  return result;
}

}  // namespace ddprpc::models
