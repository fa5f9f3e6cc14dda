#include "rpc/rpc.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>

#include <glog/logging.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "rpc/rendezvous/launch_env.h"
#include "rpc/rendezvous/store.h"

namespace ddprpc::rpc {
namespace {

absl::Mutex g_mu;
std::shared_ptr<RpcAgent> g_agent ABSL_GUARDED_BY(g_mu);
// all_gather's calls so far per set of workers, for the agent they were made on.
const RpcAgent* g_gather_agent ABSL_GUARDED_BY(g_mu) = nullptr;
absl::flat_hash_map<std::string, int64_t> g_gather_calls ABSL_GUARDED_BY(g_mu);

// rank and world size from the launcher's environment (launch_env.h).
void fill_from_environment(int* rank, int* world_size) {
  LaunchEnv env;
  try {
    env = launch_env();
  } catch (const std::invalid_argument& e) {
    throw RpcError(ErrorCode::kInvalidArgument, std::string("init_rpc: ") + e.what());
  }
  if (*rank < 0) *rank = env.rank;
  if (*world_size < 0) *world_size = env.world_size;
  if (*rank < 0 || *world_size <= 0) {
    throw RpcError(ErrorCode::kInvalidArgument,
                   "init_rpc: pass rank/world_size or set RANK and WORLD_SIZE (or start the "
                   "process with srun)");
  }
}

}  // namespace

void init_rpc(const std::string& name, int rank, int world_size, RpcBackendOptions options) {
  if (rank < 0 || world_size < 0) fill_from_environment(&rank, &world_size);
  {
    absl::MutexLock lock(&g_mu);
    if (g_agent) {
      throw RpcError(ErrorCode::kInvalidArgument,
                     "init_rpc: RPC is already initialized as '" + g_agent->self().name + "'");
    }
  }
  auto agent = std::make_shared<RpcAgent>(name, rank, world_size, std::move(options),
                                         &FunctionRegistry::global(), /*serve_now=*/false);
  {
    absl::MutexLock lock(&g_mu);
    g_agent = agent;
  }
  agent->start_serving();
}

bool shutdown(bool graceful) {
  std::shared_ptr<RpcAgent> agent;
  {
    absl::MutexLock lock(&g_mu);
    agent = g_agent;
  }
  if (!agent) return false;
  const bool clean = agent->shutdown(graceful);
  absl::MutexLock lock(&g_mu);
  if (g_agent == agent) g_agent.reset();
  return clean;
}

std::shared_ptr<RpcAgent> current_agent() {
  absl::MutexLock lock(&g_mu);
  if (!g_agent || !g_agent->running()) {
    throw RpcError(ErrorCode::kShutdown,
                   "RPC is not running: call rpc::init_rpc first (or it was shut down)");
  }
  return g_agent;
}

WorkerInfo get_worker_info() { return current_agent()->self(); }

WorkerInfo get_worker_info(const std::string& name) { return current_agent()->worker(name); }

std::vector<WorkerInfo> get_worker_infos() { return current_agent()->workers(); }

const WorkerInfo& WorkerRef::resolve(const RpcAgent& agent) const {
  if (rank_ < 0) return agent.worker(name_);
  const WorkerInfo& info = agent.worker(rank_);
  if (!name_.empty() && info.name != name_) {
    throw RpcError(ErrorCode::kInvalidArgument,
                   absl::StrCat("WorkerInfo names '", name_, "' with id ", rank_,
                                ", but worker ", rank_, " is '", info.name, "'"));
  }
  return info;
}

namespace {
thread_local WaitAllScope* t_wait_all_scope = nullptr;
}  // namespace

WaitAllScope::WaitAllScope() : previous_(t_wait_all_scope) { t_wait_all_scope = this; }

WaitAllScope::~WaitAllScope() {
  t_wait_all_scope = previous_;
  for (const auto& f : futures_) {
    f.wait_for(absl::InfiniteDuration());
    if (f.has_error()) LOG(WARNING) << "rpc::WaitAllScope: " << f.error_message();
  }
}

void WaitAllScope::wait() {
  wait_all(futures_);  // on an error, the destructor still waits for the rest
  futures_.clear();
}

void note_rpc_async(const Future<c10::IValue>& future) {
  if (t_wait_all_scope != nullptr) t_wait_all_scope->futures_.push_back(future);
}

namespace {
absl::Mutex g_debug_mu;
std::vector<std::function<void(std::map<std::string, std::string>*)>>& debug_sources()
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_debug_mu) {
  static auto* sources = new std::vector<std::function<void(std::map<std::string, std::string>*)>>();
  return *sources;
}
}  // namespace

void register_debug_info(std::function<void(std::map<std::string, std::string>*)> source) {
  absl::MutexLock lock(&g_debug_mu);
  debug_sources().push_back(std::move(source));
}

std::map<std::string, std::string> get_debug_info() {
  std::map<std::string, std::string> info = current_agent()->debug_info();
  absl::MutexLock lock(&g_debug_mu);
  for (const auto& source : debug_sources()) source(&info);
  return info;
}

absl::Duration get_rpc_timeout() { return current_agent()->rpc_timeout(); }

void set_rpc_timeout(absl::Duration timeout) { current_agent()->set_rpc_timeout(timeout); }

std::map<std::string, std::string> all_gather(const std::string& value,
                                              const std::vector<std::string>& workers,
                                              absl::Duration timeout) {
  std::shared_ptr<RpcAgent> agent = current_agent();
  std::vector<int> ids;
  if (workers.empty()) {
    for (const WorkerInfo& w : agent->workers()) ids.push_back(w.id);
  } else {
    for (const std::string& name : workers) ids.push_back(agent->worker(name).id);
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const int self = agent->self().id;
  if (!std::binary_search(ids.begin(), ids.end(), self)) {
    throw RpcError(ErrorCode::kInvalidArgument,
                   "all_gather/barrier: worker '" + agent->self().name +
                       "' is not among the workers it names");
  }
  // The n-th call of this worker with this set of workers.
  const std::string group = "rpc/gather/" + absl::StrJoin(ids, ",");
  int64_t call = 0;
  {
    absl::MutexLock lock(&g_mu);
    if (g_gather_agent != agent.get()) {
      g_gather_calls.clear();
      g_gather_agent = agent.get();
    }
    call = g_gather_calls[group]++;
  }
  const std::string prefix = absl::StrCat(group, "/", call, "/");
  Store& store = agent->store();
  store.set(prefix + std::to_string(self), value);
  std::vector<std::string> keys;
  for (int id : ids) keys.push_back(prefix + std::to_string(id));
  try {
    store.wait(keys, timeout);
  } catch (const RpcError& e) {
    if (e.code() != ErrorCode::kTimeout) throw;
    std::vector<std::string> missing;
    for (int id : ids) {
      if (!store.check({prefix + std::to_string(id)})) missing.push_back(agent->worker(id).name);
    }
    throw RpcError(ErrorCode::kTimeout,
                   absl::StrCat("all_gather/barrier on '", agent->self().name, "' timed out after ",
                                absl::FormatDuration(timeout), " waiting for ",
                                absl::StrJoin(missing, ", ")));
  }
  std::map<std::string, std::string> out;
  for (int id : ids) out[agent->worker(id).name] = store.get(prefix + std::to_string(id));
  return out;
}

void barrier(const std::vector<std::string>& workers, absl::Duration timeout) {
  all_gather("", workers, timeout);
}

}  // namespace ddprpc::rpc
