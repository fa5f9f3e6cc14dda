#include "models/hybrid_trainer.h"

#include <ATen/Context.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <optional>
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
#include "elastic/elastic_group.h"
#include "elastic/membership_watch.h"
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
// not asked for), batches dropped, the membership epoch it ended in.
using TrainerReply = std::tuple<std::vector<double>, std::vector<int64_t>, std::vector<double>,
                                std::vector<double>, at::Tensor, int64_t, int64_t,
                                std::vector<double>>;

// The store key of run `run`'s membership (elastic runs).
std::string membership_key(int64_t run) { return absl::StrCat("hybrid/", run, "/membership"); }

std::vector<std::string> world_names(const HybridWorld& world) {
  std::vector<std::string> names;
  for (int r = 0; r < world.size(); ++r) names.push_back(world.name(r));
  return names;
}

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

// Run `run`'s membership watch in this process (elastic runs); throws when
// the membership cannot be started. Its store client is its own: each call
// waits at most a collective's timeout, and fails at once when the store's
// host is gone, so that neither a removal nor the watch's end can hang on
// a lost store.
std::shared_ptr<elastic::MembershipWatch> watch_membership(const HybridTrainerOptions& o,
                                                           int64_t run) {
  const auto [host, port] = split_host_port(rpc::current_agent()->store().address());
  auto store = std::make_shared<rpc::Store>(host, port, o.collective_timeout);
  store->set_fail_fast(true);
  rpc::MembershipClient::Options options;
  options.key = membership_key(run);
  options.max_attempts = 16;
  absl::StatusOr<std::shared_ptr<elastic::MembershipWatch>> watch =
      elastic::MembershipWatch::start(std::move(store), world_names(HybridWorld(o)), options);
  if (!watch.ok()) throw std::runtime_error(std::string(watch.status().message()));
  return *watch;
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
  std::shared_ptr<elastic::MembershipWatch> watch;
  std::unique_ptr<elastic::ElasticGroup> elastic_group;
  std::shared_ptr<ddp::ProcessGroup> group;
  if (o.elastic) {
    watch = watch_membership(o, run);
    elastic::ElasticGroup::Options eo;
    eo.role = "trainer";
    eo.prefix = absl::StrCat("ddp/trainers/", run, "/elastic/");
    eo.group = group_options;
    eo.change_timeout = o.collective_timeout;
    elastic_group = std::make_unique<elastic::ElasticGroup>(
        store, watch, HybridWorld(o).name(static_cast<int>(rank)), eo);
    group = elastic_group->group();
  } else {
    group = make_group(store, absl::StrCat("ddp/trainers/", run, "/"), static_cast<int>(rank),
                       o.trainers, group_options);
  }
  ddp::DdpOptions ddp_options;
  ddp_options.timeout = o.collective_timeout;
  auto ddp = std::make_unique<ddp::DistributedDataParallel>(model.dense().ptr(), group, ddp_options);
  int64_t dropped = 0;
  std::vector<double> recovery_s;
  std::optional<absl::Time> failed_at;  // start of the batch dropped last
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
    for (const HybridTrainerOptions::Kill& kill : o.kills) {
      if (kill.trainer == rank && kill.iteration == it) {
        std::fprintf(stderr, "trainer%d: killed at iteration %d (injected fault)\n",
                     static_cast<int>(rank), it);
        std::fflush(stdout);
        std::fflush(stderr);
        ::_exit(0);
      }
    }
    const bool measured = it >= o.warmup;
    const absl::Time start = absl::Now();
    int64_t n = 0, batches = 0;
    double loss_sum = 0;
    for (const HybridBatch& b : make_batches(o, rng)) {
      absl::Time t[5];
      double loss_value = 0;
      try {
        t[0] = absl::Now();
        dist_autograd::Context context;
        at::Tensor loss = at::cross_entropy_loss(model.forward(b.indices, b.offsets), b.targets);
        loss_value = loss.item<double>();
        t[1] = absl::Now();
        dist_autograd::backward(context.id(), {loss});
        t[2] = absl::Now();
        optimizer.step(context.id());
        t[3] = absl::Now();
      } catch (const std::exception& e) {
        if (!o.elastic) throw;
        // A trainer lost in this batch (or another failure: then recover()
        // says so): the batch is dropped here as on every survivor, which
        // go on in the next epoch's group from rank 0's dense stack.
        absl::StatusOr<int64_t> epoch = elastic_group->recover({});
        if (!epoch.ok()) {
          throw std::runtime_error(absl::StrCat(e.what(), "; the trainers could not go on without ",
                                                "the lost one: ", epoch.status().message()));
        }
        ddp.reset();
        ddp = std::make_unique<ddp::DistributedDataParallel>(model.dense().ptr(),
                                                             elastic_group->group(), ddp_options);
        ++dropped;
        if (!failed_at) failed_at = t[0];
        continue;
      }
      if (failed_at) {
        recovery_s.push_back(absl::ToDoubleSeconds(absl::Now() - *failed_at));
        failed_at.reset();
      }
      n += b.targets.size(0);
      loss_sum += loss_value;
      ++batches;
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
    losses.push_back(loss_sum / static_cast<double>(std::max<int64_t>(1, batches)));
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
  return {seconds, examples, phase_ms, losses, dense, dropped,
          elastic_group ? elastic_group->epoch() : int64_t{1}, recovery_s};
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
  std::string faults;
  for (const Kill& k : kills) absl::StrAppend(&faults, " kill=trainer", k.trainer, "@", k.iteration);
  return absl::StrFormat(
      "trainers=%d ps=%d num_embeddings=%d embedding_dim=%d iters=%d warmup=%d "
      "batches_per_iter=%d lr=%g seed=%d learnable_target=%d backend=%s lookups=%s "
      "dense_kernel=%s sparse=%d elastic=%d%s",
      trainers, ps, num_embeddings, embedding_dim, iters, warmup, batches_per_iter, lr, seed,
      learnable_target, backend_name(backend), sequential_lookups ? "sequential" : "concurrent",
      dense_kernel_name(dense_kernel), sparse, elastic, faults);
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
  for (const Kill& k : kills) {
    if (k.trainer < 0 || k.trainer >= trainers || k.iteration < 0 || k.iteration >= warmup + iters) {
      return absl::StrFormat("kill of trainer%d at iteration %d: no such trainer or iteration",
                             k.trainer, k.iteration);
    }
  }
  if (elastic && backend == CollectiveBackend::kNccl) {
    return "elastic runs need the gloo backend";
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
  std::shared_ptr<elastic::MembershipWatch> watch;
  if (options.elastic) {
    watch = watch_membership(options, run);
  }
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
  // Elastic runs: a trainer removed from the membership while its call is
  // still running (stopped, cut off: its call would only end at its
  // deadline) is not waited for.
  std::vector<bool> abandoned(world.trainers(), false);
  if (watch == nullptr) {
    rpc::collect_all(runs_on).wait();
  } else {
    for (;;) {
      int waiting = -1;
      for (int r = 0; r < world.trainers(); ++r) {
        if (!runs_on[r].completed() && !abandoned[r]) waiting = r;
      }
      if (waiting < 0) break;
      if (runs_on[waiting].wait_for(absl::Milliseconds(200))) continue;
      absl::StatusOr<rpc::Membership> m = watch->current();
      for (int r = 0; m.ok() && m->epoch > 0 && r < world.trainers(); ++r) {
        if (!runs_on[r].completed() && !m->is_member(world.name(r))) abandoned[r] = true;
      }
    }
  }
  // Elastic runs: which failed trainers the membership lost (the survivors
  // removed them before they went on; a failure that is not yet in it gets
  // one more epoch's time).
  rpc::Membership membership;
  if (watch != nullptr) {
    absl::StatusOr<rpc::Membership> m = watch->current();
    for (int r = 0; m.ok() && r < world.trainers(); ++r) {
      if (runs_on[r].has_error() && m->is_member(world.name(r))) {
        absl::StatusOr<rpc::Membership> next = watch->await_change(m->epoch, absl::Seconds(10));
        if (next.ok()) m = next;
        break;
      }
    }
    if (m.ok()) membership = *m;
    result.epoch = membership.epoch;
  }
  std::vector<HybridTrainingError::Failure> failures;
  auto lose = [&result](int r, std::string reason) {
    TrainerResult lost;
    lost.lost = true;
    lost.lost_reason = std::move(reason);
    result.lost_trainers.push_back(r);
    result.trainers.push_back(std::move(lost));
  };
  for (int r = 0; r < world.trainers(); ++r) {
    if (abandoned[r] && !runs_on[r].completed()) {
      lose(r, absl::StrCat("trainer", r,
                           " was removed from the membership while its run was going on "
                           "(found unreachable by the other workers)"));
      continue;
    }
    if (runs_on[r].has_error()) {
      if (watch != nullptr && membership.epoch > 0 && !membership.is_member(world.name(r))) {
        lose(r, runs_on[r].error_message());
        continue;
      }
      failures.push_back({r, runs_on[r].error_message()});
      continue;
    }
    auto [seconds, examples, phase_ms, losses, dense, dropped, epoch, recovery] =
        runs_on[r].value();
    TrainerResult t;
    t.seconds = std::move(seconds);
    t.examples = std::move(examples);
    t.losses = std::move(losses);
    t.forward_ms = phase_ms.at(0);
    t.backward_ms = phase_ms.at(1);
    t.step_ms = phase_ms.at(2);
    t.release_ms = phase_ms.at(3);
    if (options.return_dense_parameters) t.dense_parameters = dense;
    t.dropped_batches = static_cast<int>(dropped);
    t.epoch = epoch;
    t.recovery_s = std::move(recovery);
    result.trainers.push_back(std::move(t));
  }
  if (failures.empty() && result.lost_trainers.size() == static_cast<size_t>(world.trainers())) {
    failures.push_back({0, "every trainer was lost"});
  }
  if (!failures.empty()) throw HybridTrainingError(std::move(failures));
  result.wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  if (options.fetch_tables) result.tables_after = fetch_weights(tables);
  return result;
}

}  // namespace ddprpc::models
