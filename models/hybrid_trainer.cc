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
#include <random>
#include <tuple>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "autograd/dist_autograd.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/process_group.h"
#include "elastic/elastic_group.h"
#include "elastic/membership_watch.h"
#include "glog/logging.h"
#include "models/hybrid_model.h"
#include "models/shard_checkpoint.h"
#include "optim/distributed_optimizer.h"
#include "rpc/rendezvous/store.h"
#include "rpc/rpc.h"
#include "rpc/rref/rref.h"

namespace ddprpc::models {
namespace {

constexpr char kTrainFunction[] = "ddprpc.models.hybrid_trainer.train";
constexpr char kSeedFunction[] = "ddprpc.models.hybrid_trainer.seed";
// Elastic runs: on parameter servers.
constexpr char kCheckpointFunction[] = "ddprpc.models.hybrid_trainer.checkpoint_shard";
constexpr char kHoldReplicaFunction[] = "ddprpc.models.hybrid_trainer.hold_replica";
constexpr char kReplicaIterationFunction[] = "ddprpc.models.hybrid_trainer.replica_iteration";
constexpr char kRestoreFunction[] = "ddprpc.models.hybrid_trainer.restore_shard";
constexpr char kDropReplicasFunction[] = "ddprpc.models.hybrid_trainer.drop_replicas";
constexpr char kDieFunction[] = "ddprpc.models.hybrid_trainer.die";
constexpr char kReleaseLostForksFunction[] = "ddprpc.models.hybrid_trainer.release_lost_forks";
// Elastic runs: on the master.
constexpr char kTablesFunction[] = "ddprpc.models.hybrid_trainer.tables";

// What a trainer sends back: seconds, examples, mean ms per phase (forward,
// backward, step, release), losses, flattened dense parameters (empty when
// not asked for), batches dropped, the membership epoch it ended in,
// seconds to recover from each loss, shard checkpoints it took, the
// iteration it started at (a standby: where it joined; the epoch is -1 for
// a standby the run ended without).
using TrainerReply = std::tuple<std::vector<double>, std::vector<int64_t>, std::vector<double>,
                                std::vector<double>, at::Tensor, int64_t, int64_t,
                                std::vector<double>, int64_t, int64_t>;

// What the master answers a trainer asking for the tables: how many shards
// it has restored in the run so far, and the tables.
using TablesReply = std::tuple<int64_t, std::vector<rpc::RRef<EmbeddingTable>>>;

// The store key of run `run`'s membership (elastic runs).
std::string membership_key(int64_t run) { return absl::StrCat("hybrid/", run, "/membership"); }

// The membership a run starts with: every worker but the standby trainers.
std::vector<std::string> initial_members(const HybridTrainerOptions& o) {
  const HybridWorld world(o);
  std::vector<std::string> names;
  for (int r = 0; r < world.size(); ++r) {
    if (r >= o.trainers && world.is_trainer(r)) continue;
    names.push_back(world.name(r));
  }
  return names;
}

// Store keys of run `run`: set when standby `j` may ask to join, and when
// a trainer has finished (a standby not admitted by then never joins).
std::string add_key(int64_t run, int j) { return absl::StrCat("hybrid/", run, "/add/", j); }
std::string done_key(int64_t run) { return absl::StrCat("hybrid/", run, "/done"); }

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
      elastic::MembershipWatch::start(std::move(store), initial_members(o), options);
  if (!watch.ok()) throw std::runtime_error(std::string(watch.status().message()));
  return *watch;
}

const char* backend_name(CollectiveBackend backend) {
  return backend == CollectiveBackend::kNccl ? "nccl" : "gloo";
}

// ---------------------------------------------------------------------------
// Elastic runs: shard checkpoints and restores.

// The options of this process's HybridServerService.
absl::Mutex server_mu;
std::shared_ptr<const HybridServerOptions> server ABSL_GUARDED_BY(server_mu);

std::string server_checkpoint_dir() {
  absl::MutexLock lock(&server_mu);
  return server == nullptr ? std::string() : server->checkpoint_dir;
}

void check_job(const std::string& job) {
  if (!valid_job_name(job)) throw std::invalid_argument("not a job name");
}

// The index of "ps<i>", or -1.
int ps_index(const std::string& worker) {
  int i = -1;
  absl::string_view rest = worker;
  if (!absl::ConsumePrefix(&rest, "ps") || !absl::SimpleAtoi(rest, &i)) return -1;
  return i;
}

// The parameter servers of `m`, by index.
std::vector<std::string> servers_of(const rpc::Membership& m) {
  std::vector<std::string> out;
  for (const std::string& w : m.members) {
    if (ps_index(w) >= 0) out.push_back(w);
  }
  std::sort(out.begin(), out.end(),
            [](const std::string& a, const std::string& b) { return ps_index(a) < ps_index(b); });
  return out;
}

// The first of `servers` after `server` in ring order, or "" when there is
// no other.
std::string next_server(const std::vector<std::string>& servers, const std::string& server) {
  const int from = ps_index(server);
  std::string best;
  int best_distance = 0;
  for (const std::string& s : servers) {
    const int i = ps_index(s);
    if (s == server) continue;
    const int distance = i > from ? i - from : i - from + (1 << 20);
    if (best.empty() || distance < best_distance) best = s, best_distance = distance;
  }
  return best;
}

// On a parameter server: checkpoint `table` (shard `shard` of job `job`,
// taken at `iteration`) to this server's checkpoint directory and, when
// `replica` names another server, into its memory. Returns the steps the
// checkpoint holds; throws when it was kept nowhere.
int64_t checkpoint_shard(rpc::RRef<EmbeddingTable> table, std::string job, int64_t shard,
                         int64_t iteration, std::string replica) {
  check_job(job);
  auto [weight, steps] = table.local_value()->snapshot();
  ShardCheckpoint c{shard, iteration, steps, weight};
  const std::string dir = server_checkpoint_dir();
  std::string errors;
  int kept = 0;
  if (!dir.empty()) {
    absl::Status ok = write_shard_file(dir, job, c);
    if (ok.ok()) ++kept;
    else absl::StrAppend(&errors, " ", ok.message());
  }
  if (!replica.empty()) {
    try {
      rpc::rpc_sync<void>(replica, kHoldReplicaFunction, job, shard, iteration, steps, weight);
      ++kept;
    } catch (const std::exception& e) {
      absl::StrAppend(&errors, " replica on ", replica, ": ", e.what());
    }
  }
  if (kept > 0 && !errors.empty()) {
    LOG_FIRST_N(WARNING, 4) << "checkpoint of shard " << shard << " at iteration " << iteration
                            << " kept in part:" << errors;
  }
  if (kept == 0) {
    throw std::runtime_error(absl::StrCat(
        "checkpoint of shard ", shard, " at iteration ", iteration, " was kept nowhere",
        errors.empty() ? std::string(" (no checkpoint directory here, no replica named)")
                       : absl::StrCat(":", errors)));
  }
  return steps;
}
DDPRPC_REGISTER_FUNCTION_AS(hybrid_trainer_checkpoint_shard, kCheckpointFunction,
                            &checkpoint_shard);

void hold_replica_here(std::string job, int64_t shard, int64_t iteration, int64_t steps,
                       at::Tensor weight) {
  absl::Status ok = hold_replica(job, ShardCheckpoint{shard, iteration, steps, std::move(weight)});
  if (!ok.ok()) throw std::runtime_error(std::string(ok.message()));
}
DDPRPC_REGISTER_FUNCTION_AS(hybrid_trainer_hold_replica, kHoldReplicaFunction, &hold_replica_here);

// The iteration of the replica of `shard` held here, or -1.
int64_t replica_iteration(std::string job, int64_t shard) {
  check_job(job);
  std::optional<ShardCheckpoint> c = held_replica(job, shard);
  return c ? c->iteration : -1;
}
DDPRPC_REGISTER_FUNCTION_AS(hybrid_trainer_replica_iteration, kReplicaIterationFunction,
                            &replica_iteration);

// The end of a run: its replicas and checkpoint files go.
void drop_replicas_here(std::string job) {
  check_job(job);
  drop_replicas(job);
  remove_shard_files(server_checkpoint_dir(), job);
}
DDPRPC_REGISTER_FUNCTION_AS(hybrid_trainer_drop_replicas, kDropReplicasFunction,
                            &drop_replicas_here);

// On a worker of run `run`: lost workers never delete the RRefs they held
// (a trainer's optimizer state on the servers, its forks of the tables), so
// those of `workers` that the run's membership no longer lists are released
// here. Returns the forks released.
int64_t release_lost_forks(int64_t run, std::vector<std::string> workers) {
  rpc::MembershipClient::Options options;
  options.key = membership_key(run);
  rpc::MembershipClient client(rpc::membership_store(&rpc::current_agent()->store()), options);
  absl::StatusOr<rpc::Membership> m = client.current();
  if (!m.ok()) {
    throw std::runtime_error(absl::StrCat("no membership of run ", run, ": ", m.status().message()));
  }
  int64_t released = 0;
  for (const std::string& w : workers) {
    if (m->is_member(w) || m->is_joining(w)) {
      throw std::invalid_argument(absl::StrCat(w, " is still in run ", run, "'s membership"));
    }
    released += rpc::release_forks_held_by(w);
  }
  return released;
}
DDPRPC_REGISTER_FUNCTION_AS(hybrid_trainer_release_lost_forks, kReleaseLostForksFunction,
                            &release_lost_forks);

// What a restore found: the new table (owned here), the checkpoint's
// iteration and steps, and where it came from.
using RestoreReply = std::tuple<rpc::RRef<EmbeddingTable>, int64_t, int64_t, std::string>;

// On a surviving parameter server: a table of `rows` x `dim` built here from
// the newest checkpoint of `shard` this server can reach (a replica it
// holds, or its checkpoint directory's file), taken to hold `steps` steps
// (the surviving shards' count: the steps the checkpoint lacks are lost).
RestoreReply restore_shard(std::string job, int64_t shard, int64_t rows, int64_t dim,
                           int64_t steps) {
  check_job(job);
  std::optional<ShardCheckpoint> best = held_replica(job, shard);
  std::string source = best ? "replica" : "";
  std::string file_error;
  if (const std::string dir = server_checkpoint_dir(); !dir.empty()) {
    absl::StatusOr<ShardCheckpoint> file = read_shard_file(dir, job, shard, rows, dim);
    if (!file.ok()) {
      file_error = std::string(file.status().message());
    } else if (!best || file->iteration > best->iteration) {
      best = std::move(*file);
      source = "file";
    }
  }
  if (!best) {
    throw std::runtime_error(absl::StrCat(
        "no checkpoint of shard ", shard, " here (no replica",
        file_error.empty() ? ", no checkpoint directory" : absl::StrCat("; ", file_error), ")"));
  }
  if (best->weight.size(0) != rows || best->weight.size(1) != dim) {
    throw std::runtime_error(absl::StrCat("the replica of shard ", shard, " is not ", rows, "x", dim));
  }
  auto table = std::make_shared<EmbeddingTable>(rows, dim);
  table->restore(best->weight, std::max(steps, best->steps));
  return {rpc::RRef<EmbeddingTable>(std::move(table)), best->iteration, best->steps, source};
}
DDPRPC_REGISTER_FUNCTION_AS(hybrid_trainer_restore_shard, kRestoreFunction, &restore_shard);

// An injected fault: this process ends at once, as a crash would end it.
[[noreturn]] void die(const std::string& why) {
  const std::shared_ptr<rpc::RpcAgent> agent = rpc::current_agent();
  std::fprintf(stderr, "%s: killed %s (injected fault)\n",
               agent ? agent->self().name.c_str() : "?", why.c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(0);
}

// The same, asked for by a job member: only on a server that accepts it.
void die_on_request(std::string why) {
  bool accepted = false;
  {
    absl::MutexLock lock(&server_mu);
    accepted = server != nullptr && server->accept_injected_faults;
  }
  if (!accepted) throw std::runtime_error("this worker accepts no injected faults");
  die(why);
}
DDPRPC_REGISTER_FUNCTION_AS(hybrid_trainer_die, kDieFunction, &die_on_request);

// Checkpoints in flight: each call's shard and iteration.
struct PendingCheckpoints {
  std::vector<std::tuple<int64_t, int64_t, rpc::Future<int64_t>>> calls;
};

// Starts checkpointing shard i of `tables` (but those on `skip`'s servers)
// at `iteration`, each replicated to the next server of `m` when
// `replicate`, without waiting: the calls join `pending`.
void start_checkpoints(const std::vector<rpc::RRef<EmbeddingTable>>& tables,
                       const std::string& job, int64_t iteration, const rpc::Membership& m,
                       bool replicate, const std::vector<std::string>& skip,
                       absl::Duration timeout, PendingCheckpoints& pending) {
  const std::vector<std::string> servers = servers_of(m);
  for (size_t i = 0; i < tables.size(); ++i) {
    const std::string host = tables[i].owner_name();
    if (std::find(skip.begin(), skip.end(), host) != skip.end()) continue;
    const std::string replica = replicate ? next_server(servers, host) : std::string();
    pending.calls.emplace_back(
        i, iteration,
        rpc::rpc_async<int64_t>(rpc::CallOptions{timeout}, host, kCheckpointFunction, tables[i],
                                job, static_cast<int64_t>(i), iteration, replica));
  }
}

// Waits for the checkpoints of `pending` (each bounded by its call's
// timeout). Returns how many were taken; logs those that failed (a server
// lost shows up in the next batch) and keeps the first error in `error`.
int64_t finish_checkpoints(PendingCheckpoints& pending, std::string* error = nullptr) {
  int64_t taken = 0;
  for (auto& [shard, iteration, call] : pending.calls) {
    call.wait_for(absl::InfiniteDuration());
    if (!call.has_error()) {
      ++taken;
      continue;
    }
    LOG_FIRST_N(WARNING, 8) << "checkpoint of shard " << shard << " at iteration " << iteration
                            << " failed: " << call.error_message();
    if (error != nullptr && error->empty()) *error = call.error_message();
  }
  pending.calls.clear();
  return taken;
}

// The master's tables of each elastic run in progress, by job, for the
// trainers to re-bind to after a restore.
struct RunTables {
  absl::Mutex mu;
  int64_t epoch ABSL_GUARDED_BY(mu) = 0;  // the membership epoch they are current for
  int64_t restores ABSL_GUARDED_BY(mu) = 0;
  std::vector<rpc::RRef<EmbeddingTable>> tables ABSL_GUARDED_BY(mu);
  std::string error ABSL_GUARDED_BY(mu);  // why a shard could not be restored
  absl::Duration timeout;                 // of a trainer's wait
};

absl::Mutex runs_mu;
std::map<std::string, std::shared_ptr<RunTables>>* runs_in_progress ABSL_GUARDED_BY(runs_mu) =
    new std::map<std::string, std::shared_ptr<RunTables>>();

// On the master: the tables of `job` once they are current for membership
// epoch `epoch` (every shard of a server lost by then restored).
TablesReply tables_of(std::string job, int64_t epoch) {
  std::shared_ptr<RunTables> run;
  {
    absl::MutexLock lock(&runs_mu);
    auto it = runs_in_progress->find(job);
    if (it != runs_in_progress->end()) run = it->second;
  }
  if (run == nullptr) throw std::invalid_argument("no elastic run of that job on this worker");
  absl::MutexLock lock(&run->mu);
  auto ready = [&run, epoch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(run->mu) {
    return run->epoch >= epoch || !run->error.empty();
  };
  if (!run->mu.AwaitWithTimeout(absl::Condition(&ready), run->timeout)) {
    throw std::runtime_error(absl::StrCat("the master's tables are not current for membership epoch ",
                                          epoch, " after ", absl::FormatDuration(run->timeout)));
  }
  if (!run->error.empty()) throw std::runtime_error(run->error);
  return {run->restores, run->tables};
}
DDPRPC_REGISTER_FUNCTION_AS(hybrid_trainer_tables, kTablesFunction, &tables_of);

// A standby trainer (`self`, adds[j]) of run `run`: waits for the
// trainers' rank 0 to reach the iteration it joins at, asks to join and
// waits to be admitted. Returns the epoch that admitted it (the one the
// trainers move to), or -1 when the run's trainers finished first.
absl::StatusOr<int64_t> join_as_standby(const HybridTrainerOptions& o, int64_t run, rpc::Store& store,
                                     elastic::MembershipWatch& watch, const std::string& self,
                                     int j) {
  const absl::Time deadline = absl::Now() + o.run_timeout;
  auto timed_out = [&](const char* what) {
    return absl::DeadlineExceededError(absl::StrCat(self, " (standby) ", what, " within ",
                                                    absl::FormatDuration(o.run_timeout)));
  };
  while (!store.check({add_key(run, j)})) {
    if (store.check({done_key(run)})) return -1;
    if (absl::Now() > deadline) return timed_out("was never called to join");
    absl::SleepFor(absl::Milliseconds(20));
  }
  absl::StatusOr<rpc::Membership> m = watch.request_join(self);
  if (!m.ok()) return m.status();
  // The epochs from here to the one that admits it list it as joining.
  int64_t joining_since = m->is_joining(self) ? m->epoch : m->epoch - 1;
  for (;;) {
    if (m->is_member(self)) {
      // A worker lost right after the admission may have moved the record
      // on: the admitting epoch is the first to list this one as a member.
      for (int64_t e = joining_since + 1; e < m->epoch; ++e) {
        absl::StatusOr<rpc::Membership> then = watch.at_epoch(e);
        if (!then.ok()) return then.status();
        if (then->is_member(self)) return e;
      }
      return m->epoch;
    }
    if (!m->is_joining(self)) {
      return absl::FailedPreconditionError(
          absl::StrCat(self, " (standby) was taken out of the membership while it waited"));
    }
    joining_since = m->epoch;
    if (store.check({done_key(run)})) return -1;
    if (absl::Now() > deadline) return timed_out("was not admitted");
    absl::StatusOr<rpc::Membership> next = watch.await_change(m->epoch, absl::Milliseconds(200));
    if (next.ok()) m = next;
  }
}

// Runs on trainer `rank`, called by the master: run `run` of the world
// (job `job`), over `tables`.
TrainerReply train(std::vector<rpc::RRef<EmbeddingTable>> tables, int64_t rank, int64_t run,
                   std::string job, std::string master_workload, bool return_dense) {
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
  const std::string self = HybridWorld(o).name(static_cast<int>(rank));
  // A standby (adds): joins when the trainers' rank 0 starts its iteration.
  const int standby = static_cast<int>(rank) - o.trainers;  // >= 0: adds[standby]
  int first_iteration = 0;
  absl::StatusOr<int64_t> admitted = -1;  // a standby: the epoch that admitted it
  if (o.elastic) {
    watch = watch_membership(o, run);
    if (standby >= 0) {
      admitted = join_as_standby(o, run, *store, *watch, self, standby);
      if (!admitted.ok()) throw std::runtime_error(std::string(admitted.status().message()));
      if (*admitted < 0) {
        TrainerReply never;
        std::get<4>(never) = at::empty({0});
        std::get<6>(never) = -1;  // never joined
        return never;
      }
    }
    elastic::ElasticGroup::Options eo;
    eo.role = "trainer";
    eo.prefix = absl::StrCat("ddp/trainers/", run, "/elastic/");
    eo.group = group_options;
    eo.change_timeout = o.collective_timeout;
    elastic_group = std::make_unique<elastic::ElasticGroup>(store, watch, self, eo);
    // A standby meets the trainers in the group of the epoch that admitted
    // it (below), as they do.
    if (standby < 0) group = elastic_group->group();
  } else {
    group = make_group(store, absl::StrCat("ddp/trainers/", run, "/"), static_cast<int>(rank),
                       o.trainers, group_options);
  }
  ddp::DdpOptions ddp_options;
  ddp_options.timeout = o.collective_timeout;
  // A standby builds its DDP when it meets the others (below). Nothing
  // else holds the group: when it is given up, its members must see it go.
  std::unique_ptr<ddp::DistributedDataParallel> ddp;
  if (standby < 0) {
    ddp = std::make_unique<ddp::DistributedDataParallel>(model.dense().ptr(), std::move(group),
                                                         ddp_options);
  }
  group.reset();
  int64_t dropped = 0, checkpoints = 0;
  PendingCheckpoints pending_checkpoints;  // taken by this trainer as rank 0
  std::vector<double> recovery_s;
  std::optional<absl::Time> failed_at;  // start of the batch dropped last
  auto make_optimizer = [&model, &o] {
    return std::make_unique<optim::DistributedOptimizer>(
        "sgd", std::map<std::string, double>{{"lr", o.lr}}, model.parameter_rrefs());
  };
  std::unique_ptr<optim::DistributedOptimizer> optimizer;
  int64_t restores_seen = 0;  // the master's count of restored shards
  int64_t batch_index = 0;    // of the run: the same batch on every trainer
  int64_t resume_at = 0;      // elastic runs: the batches before it are dropped

  // Elastic runs, after the group changed (ddp dropped): DDP over the new
  // group (rank 0's dense stack broadcast to every member), the tables of
  // that epoch (a lost server's shards restored elsewhere: the tables and
  // the optimizer follow them), and the batch every member goes on from:
  // the one after the furthest batch any member reached (a trainer whose
  // call to a lost server failed a batch earlier than another's drops one
  // more; a standby joining takes the others').
  auto regrouped = [&](int64_t epoch) {
    ddp = std::make_unique<ddp::DistributedDataParallel>(model.dense().ptr(),
                                                         elastic_group->group(), ddp_options);
    auto [restores, current] = rpc::rpc_sync<TablesReply>(
        rpc::CallOptions{o.collective_timeout + absl::Seconds(5)}, "master", kTablesFunction, job,
        epoch);
    if (restores != restores_seen || optimizer == nullptr) {
      if (restores != restores_seen) model.set_tables(std::move(current));
      optimizer.reset();
      optimizer = make_optimizer();
      restores_seen = restores;
    }
    at::Tensor next = at::tensor(std::vector<int64_t>{batch_index}, at::kLong);
    elastic_group->group()->allreduce_and_wait({next}, ddp::ReduceOp::kMax, o.collective_timeout);
    resume_at = next.item<int64_t>();
  };
  // Elastic runs, after a batch or a collective failed: a trainer lost (or
  // another failure: then recover() says so); every survivor goes on in
  // the next epoch's group. This one's hold on the old group goes first: a
  // survivor still waiting in one of its collectives fails at once instead
  // of at its timeout.
  auto recover = [&](const std::exception& e, int it) {
    LOG(WARNING) << "trainer" << rank << ": iteration " << it << ": " << e.what();
    ddp.reset();
    absl::StatusOr<int64_t> epoch = elastic_group->recover({});
    if (!epoch.ok()) {
      throw std::runtime_error(absl::StrCat(e.what(), "; the trainers could not go on without ",
                                            "the lost one: ", epoch.status().message()));
    }
    regrouped(*epoch);
  };
  if (standby >= 0) {
    // The others admitted this one at the start of an iteration, where it
    // meets them: their dense stack, their tables, their next batch. If it
    // cannot, it takes itself out of the membership before it fails: the
    // trainers' recovery then goes on without it instead of waiting for a
    // member that answers its pings but never takes part.
    try {
      absl::StatusOr<int64_t> joined = elastic_group->advance(*admitted);
      if (!joined.ok()) throw std::runtime_error(std::string(joined.status().message()));
      regrouped(*joined);
    } catch (const std::exception& e) {
      absl::StatusOr<rpc::Membership> left = watch->remove(self);
      throw std::runtime_error(absl::StrCat(
          self, " (standby) could not join the trainers in epoch ", *admitted, ": ", e.what(),
          left.ok() ? "; it left the membership"
                    : absl::StrCat("; leaving the membership failed too: ", left.status().message())));
    }
    first_iteration = static_cast<int>(resume_at / o.batches_per_iter);
    batch_index = int64_t{first_iteration} * o.batches_per_iter;
    LOG(WARNING) << self << ": joined the trainers at iteration " << first_iteration << " (epoch "
                 << elastic_group->epoch() << ")";
  } else {
    optimizer = make_optimizer();
  }

  std::vector<double> seconds, losses;
  std::vector<int64_t> examples;
  std::vector<double> phase_ms(4, 0.0);  // forward, backward, step, release
  int64_t measured_batches = 0;
  const int total = o.iters + o.warmup;
  TrainerProgress progress;
  progress.rank = static_cast<int>(rank);
  progress.total = total;
  if (service->on_progress) service->on_progress(progress);
  for (int it = first_iteration; it < total; ++it) {
    for (const HybridTrainerOptions::Kill& kill : o.kills) {
      if (kill.role == HybridTrainerOptions::Role::kTrainer && kill.index == rank &&
          kill.iteration == it) {
        die(absl::StrCat("at iteration ", it));
      }
    }
    // Elastic runs: the trainers' rank 0 injects the servers' faults of
    // this iteration, then checkpoints the other shards, then lets this
    // iteration's standbys ask to join.
    if (o.elastic && elastic_group->rank() == 0 && !(standby >= 0 && it == first_iteration)) {
      std::vector<std::string> killed;
      for (const HybridTrainerOptions::Kill& kill : o.kills) {
        if (kill.role != HybridTrainerOptions::Role::kPs || kill.iteration != it) continue;
        killed.push_back(absl::StrCat("ps", kill.index));
        // Its answer never comes: the server ends as it reads the call.
        rpc::rpc_async<void>(killed.back(), kDieFunction,
                             absl::StrCat("when trainer", rank, " started iteration ", it));
      }
      // Checkpoints run beside training: the servers copy their shards
      // between optimizer steps; the last ones are waited for here.
      if (o.checkpoint_every > 0 && it > 0 && it % o.checkpoint_every == 0) {
        checkpoints += finish_checkpoints(pending_checkpoints);
        absl::StatusOr<rpc::Membership> m = watch->current();
        if (m.ok()) {
          start_checkpoints(model.tables(), job, it, *m, o.replicate_checkpoints, killed,
                            o.collective_timeout, pending_checkpoints);
        }
      }
      for (size_t j = 0; j < o.adds.size(); ++j) {
        if (o.adds[j].iteration == it) store->set(add_key(run, static_cast<int>(j)), "go");
      }
    }
    // Elastic runs with standbys: at each iteration's start rank 0 admits
    // those waiting, and every member learns of it (the largest epoch any
    // member sees) and moves to the grown group at this same boundary.
    if (o.elastic && !o.adds.empty() && !(standby >= 0 && it == first_iteration)) {
      const absl::Time check_start = absl::Now();
      // After a recovery the check runs again: a survivor that recovered
      // from a batch of the last iteration comes to this check only now.
      for (int attempt = 0;; ++attempt) {
        try {
          int64_t seen = elastic_group->epoch();
          if (elastic_group->rank() == 0) {
            absl::StatusOr<rpc::Membership> m = watch->current();
            if (m.ok() && !m->joining.empty()) {
              absl::StatusOr<rpc::Membership> admitted = watch->admit_joining();
              if (admitted.ok()) seen = admitted->epoch;
            }
          }
          at::Tensor epoch = at::tensor(std::vector<int64_t>{seen}, at::kLong);
          elastic_group->group()->allreduce_and_wait({epoch}, ddp::ReduceOp::kMax,
                                                     o.collective_timeout);
          if (epoch.item<int64_t>() > elastic_group->epoch()) {
            ddp.reset();
            absl::StatusOr<int64_t> grown = elastic_group->advance(epoch.item<int64_t>());
            if (!grown.ok()) {
              throw std::runtime_error(absl::StrCat("admitting the standby trainers: ",
                                                    grown.status().message()));
            }
            regrouped(*grown);
          }
          break;
        } catch (const std::exception& e) {
          if (attempt > HybridWorld(o).trainers()) throw;
          recover(e, it);  // no batch dropped; the recovery is timed from here
          if (!failed_at) failed_at = check_start;
        }
      }
    }
    const bool measured = it >= o.warmup;
    const absl::Time start = absl::Now();
    int64_t n = 0, batches = 0;
    double loss_sum = 0;
    for (const HybridBatch& b : make_batches(o, rng)) {
      if (batch_index++ < resume_at) {
        ++dropped;
        continue;
      }
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
        optimizer->step(context.id());
        t[3] = absl::Now();
      } catch (const std::exception& e) {
        if (!o.elastic) throw;
        recover(e, it);
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
  checkpoints += finish_checkpoints(pending_checkpoints);
  // A standby waiting to join does not wait past the run.
  if (o.elastic && !o.adds.empty()) store->set(done_key(run), "1");
  for (double& ms : phase_ms) ms /= std::max<int64_t>(1, measured_batches);
  at::Tensor dense = at::empty({0});
  if (return_dense) {
    std::vector<at::Tensor> flat;
    for (const auto& p : model.dense()->parameters()) flat.push_back(p.detach().reshape({-1}));
    dense = at::cat(flat).clone();
  }
  return {seconds,
          examples,
          phase_ms,
          losses,
          dense,
          dropped,
          elastic_group ? elastic_group->epoch() : int64_t{1},
          recovery_s,
          checkpoints,
          first_iteration};
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
  for (const Kill& k : kills) {
    absl::StrAppend(&faults, " kill=", k.role == Role::kPs ? "ps" : "trainer", k.index, "@",
                    k.iteration);
  }
  for (const Add& a : adds) absl::StrAppend(&faults, " add=trainer@", a.iteration);
  return absl::StrFormat(
      "trainers=%d ps=%d num_embeddings=%d embedding_dim=%d iters=%d warmup=%d "
      "batches_per_iter=%d lr=%g seed=%d learnable_target=%d backend=%s lookups=%s "
      "dense_kernel=%s sparse=%d elastic=%d checkpoint_every=%d replicate_checkpoints=%d%s",
      trainers, ps, num_embeddings, embedding_dim, iters, warmup, batches_per_iter, lr, seed,
      learnable_target, backend_name(backend), sequential_lookups ? "sequential" : "concurrent",
      dense_kernel_name(dense_kernel), sparse, elastic, checkpoint_every, replicate_checkpoints,
      faults);
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
    const bool ps_kill = k.role == Role::kPs;
    if (k.index < 0 || k.index >= (ps_kill ? ps : trainers) || k.iteration < 0 ||
        k.iteration >= warmup + iters) {
      return absl::StrFormat("kill of %s%d at iteration %d: no such %s or iteration",
                             ps_kill ? "ps" : "trainer", k.index, k.iteration,
                             ps_kill ? "parameter server" : "trainer");
    }
    if (ps_kill && !elastic) return "killing a parameter server needs an elastic run";
  }
  if (checkpoint_every < 0) return "checkpoint_every must be at least 0";
  for (const Add& a : adds) {
    if (!elastic) return "standby trainers (adds) need an elastic run";
    if (a.iteration < 0 || a.iteration >= warmup + iters) {
      return absl::StrFormat("a trainer added at iteration %d: no such iteration", a.iteration);
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

HybridServerService::HybridServerService(HybridServerOptions options) {
  auto kept = std::make_shared<const HybridServerOptions>(std::move(options));
  absl::MutexLock lock(&server_mu);
  if (server != nullptr) throw std::logic_error("a HybridServerService already runs in this process");
  server = std::move(kept);
}

HybridServerService::~HybridServerService() {
  absl::MutexLock lock(&server_mu);
  server.reset();
}

namespace {

// A job's name for checkpoints: unique to the run.
std::string new_job_name(int64_t run) {
  std::random_device random;
  return absl::StrFormat("hybrid%d-%08x%08x", run, random(), random());
}

// Elastic runs, on the master: restores on surviving servers of `m` each
// shard whose server `m` lost, into `tables` (shared with the trainers
// through `run_tables`). Throws when a shard cannot be restored.
void restore_lost_shards(const HybridTrainerOptions& o, const std::string& job,
                         const rpc::Membership& m, RunTables& run_tables,
                         std::vector<rpc::RRef<EmbeddingTable>>& tables,
                         std::vector<ShardRestore>& restores) {
  const std::vector<std::string> servers = servers_of(m);
  const rpc::CallOptions call{o.collective_timeout};
  for (size_t i = 0; i < tables.size(); ++i) {
    const std::string lost = tables[i].owner_name();
    if (m.is_member(lost)) continue;
    const absl::Time start = absl::Now();
    const std::string shard = absl::StrCat("shard ", i, " (lost with ", lost, ")");
    if (servers.empty()) throw std::runtime_error(absl::StrCat(shard, ": every server is lost"));
    // Where it goes: the server holding its newest replica, else the next
    // one (its own checkpoint directory).
    std::vector<rpc::Future<int64_t>> held;
    for (const std::string& s : servers) {
      held.push_back(rpc::rpc_async<int64_t>(call, s, kReplicaIterationFunction, job,
                                             static_cast<int64_t>(i)));
    }
    std::string to = next_server(servers, lost);
    int64_t newest = -1;
    for (size_t s = 0; s < servers.size(); ++s) {
      held[s].wait_for(absl::InfiniteDuration());
      if (!held[s].has_error() && held[s].value() > newest) {
        newest = held[s].value();
        to = servers[s];
      }
    }
    // The steps it should hold: the most any surviving shard has applied.
    int64_t steps = 0;
    std::vector<rpc::Future<int64_t>> counts;
    for (const auto& table : tables) {
      if (m.is_member(table.owner_name())) counts.push_back(table.rpc_async(call, &EmbeddingTable::steps));
    }
    for (auto& c : counts) {
      c.wait_for(absl::InfiniteDuration());
      if (!c.has_error()) steps = std::max(steps, c.value());
    }
    RestoreReply restored;
    try {
      restored = rpc::rpc_sync<RestoreReply>(call, to, kRestoreFunction, job, static_cast<int64_t>(i),
                                             o.num_embeddings, o.embedding_dim, steps);
    } catch (const std::exception& e) {
      throw std::runtime_error(absl::StrCat(shard, " could not be restored on ", to, ": ", e.what()));
    }
    auto& [table, iteration, checkpoint_steps, source] = restored;
    ShardRestore r;
    r.shard = static_cast<int>(i);
    r.lost_server = lost;
    r.restored_on = to;
    r.source = source;
    r.epoch = m.epoch;
    r.checkpoint_iteration = iteration;
    r.updates_lost = std::max<int64_t>(0, steps - checkpoint_steps);
    r.seconds = absl::ToDoubleSeconds(absl::Now() - start);
    LOG(WARNING) << shard << " restored on " << to << " from its " << source
                 << " of iteration " << iteration << ": " << r.updates_lost << " updates lost";
    restores.push_back(r);
    tables[i] = table;
    absl::MutexLock lock(&run_tables.mu);
    run_tables.tables = tables;
    ++run_tables.restores;
  }
}

}  // namespace

HybridRunResult run_hybrid_training(const HybridTrainerOptions& options) {
  const std::string why = options.invalid();
  if (!why.empty()) throw std::invalid_argument("run_hybrid_training: " + why);
  static std::atomic<int64_t> runs{0};  // each run's process group has its own keys
  const int64_t run = runs.fetch_add(1);
  const std::string job = new_job_name(run);
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
  // Elastic runs: every shard is checkpointed before training, and the
  // trainers find the tables here after a restore.
  auto run_tables = std::make_shared<RunTables>();
  struct Unlist {
    explicit Unlist(std::string job) : job(std::move(job)) {}
    Unlist(const Unlist&) = delete;
    Unlist& operator=(const Unlist&) = delete;
    const std::string job;
    ~Unlist() {
      absl::MutexLock lock(&runs_mu);
      runs_in_progress->erase(job);
    }
  };
  std::optional<Unlist> unlist;
  int64_t handled_epoch = 0;
  if (watch != nullptr) {
    absl::StatusOr<rpc::Membership> m = watch->current();
    if (!m.ok()) throw std::runtime_error(std::string(m.status().message()));
    std::string error;
    PendingCheckpoints first;
    start_checkpoints(tables, job, 0, *m, options.replicate_checkpoints, {},
                      options.collective_timeout, first);
    result.checkpoints = finish_checkpoints(first, &error);
    if (result.checkpoints < static_cast<int64_t>(tables.size())) {
      // Training goes on; a server lost before a later checkpoint of its
      // shards ends the run with the restore's error.
      LOG(WARNING) << "elastic run: the shards' first checkpoint failed (" << error
                   << "); a parameter server lost now cannot be replaced";
    }
    handled_epoch = m->epoch;
    {
      absl::MutexLock lock(&run_tables->mu);
      run_tables->epoch = m->epoch;
      run_tables->tables = tables;
      run_tables->timeout = options.collective_timeout;
    }
    {
      absl::MutexLock lock(&runs_mu);
      runs_in_progress->emplace(job, run_tables);
    }
    unlist.emplace(job);
  }
  std::vector<rpc::Future<TrainerReply>> runs_on;
  for (int r = 0; r < world.trainers(); ++r) {
    runs_on.push_back(rpc::rpc_async<TrainerReply>(
        rpc::CallOptions{options.run_timeout}, world.name(r), kTrainFunction, tables, int64_t{r},
        run, job, options.workload(), options.return_dense_parameters));
  }
  // Elastic runs: each change of the membership is handled as it comes
  // (the shards of a lost server restored), and a trainer removed from the
  // membership while its call is still running (stopped, cut off: its call
  // would only end at its deadline) is not waited for.
  std::vector<bool> abandoned(world.trainers(), false);
  // Trainers that are or were members (a standby becomes one when admitted).
  std::vector<bool> member(world.trainers(), false);
  for (int r = 0; r < options.trainers; ++r) member[r] = true;
  std::string restore_error;
  if (watch == nullptr) {
    rpc::collect_all(runs_on).wait();
  } else {
    for (;;) {
      bool waiting = false;
      for (int r = 0; r < world.trainers(); ++r) {
        waiting = waiting || (!runs_on[r].completed() && !abandoned[r]);
      }
      if (!waiting) break;
      absl::StatusOr<rpc::Membership> m = watch->await_change(handled_epoch, absl::Milliseconds(100));
      if (!m.ok() || m->epoch <= handled_epoch) continue;
      for (int r = 0; r < world.trainers(); ++r) {
        if (m->is_member(world.name(r))) member[r] = true;
        if (member[r] && !runs_on[r].completed() && !m->is_member(world.name(r))) {
          abandoned[r] = true;
        }
      }
      if (restore_error.empty()) {
        try {
          restore_lost_shards(options, job, *m, *run_tables, tables, result.restores);
        } catch (const std::exception& e) {
          restore_error = e.what();
          LOG(ERROR) << "elastic run: " << restore_error;
        }
      }
      handled_epoch = m->epoch;
      absl::MutexLock lock(&run_tables->mu);
      run_tables->epoch = m->epoch;
      if (!restore_error.empty()) run_tables->error = restore_error;
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
    auto [seconds, examples, phase_ms, losses, dense, dropped, epoch, recovery, checkpoints,
          first_iteration] = runs_on[r].value();
    result.checkpoints += checkpoints;
    TrainerResult t;
    if (epoch < 0) {  // a standby the run ended without
      t.joined = false;
      result.trainers.push_back(std::move(t));
      continue;
    }
    t.first_iteration = static_cast<int>(first_iteration);
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
  const bool trained = std::any_of(result.trainers.begin(), result.trainers.end(),
                                   [](const TrainerResult& t) { return !t.lost && t.joined; });
  if (failures.empty() && !trained) failures.push_back({0, "every trainer was lost"});
  result.wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  if (watch != nullptr && !result.lost_trainers.empty()) {
    // What the lost trainers held, here and on the servers (best effort).
    std::vector<std::string> lost;
    for (int r : result.lost_trainers) lost.push_back(world.name(r));
    std::vector<std::pair<std::string, rpc::Future<int64_t>>> releases;
    for (const std::string& s : servers_of(membership)) {
      releases.emplace_back(s, rpc::rpc_async<int64_t>(rpc::CallOptions{options.collective_timeout},
                                                       s, kReleaseLostForksFunction, run, lost));
    }
    try {
      release_lost_forks(run, lost);
    } catch (const std::exception& e) {
      LOG(WARNING) << "elastic run: releasing the lost trainers' RRefs here failed: " << e.what();
    }
    for (auto& [server, call] : releases) {
      call.wait();  // ends by the call's timeout
      if (call.has_error()) {
        LOG(WARNING) << "elastic run: releasing the lost trainers' RRefs on " << server
                     << " failed: " << call.error_message();
      }
    }
  }
  if (watch != nullptr) {
    // The replicas and checkpoint files go with the run, whether it
    // succeeded or failed (best effort: a server may be gone).
    std::vector<rpc::Future<void>> dropped;
    for (const std::string& s : servers_of(membership)) {
      dropped.push_back(rpc::rpc_async<void>(rpc::CallOptions{options.collective_timeout}, s,
                                             kDropReplicasFunction, job));
    }
    for (auto& d : dropped) d.wait_for(absl::InfiniteDuration());
  }
  if (!failures.empty()) throw HybridTrainingError(std::move(failures));
  if (options.fetch_tables) result.tables_after = fetch_weights(tables);
  return result;
}

}  // namespace ddprpc::models
