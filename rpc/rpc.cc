#include "rpc/rpc.h"

#include <cstdlib>
#include <stdexcept>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "rpc/launch_env.h"

namespace ddprpc::rpc {
namespace {

absl::Mutex g_mu;
std::shared_ptr<RpcAgent> g_agent ABSL_GUARDED_BY(g_mu);

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

void shutdown(bool graceful) {
  std::shared_ptr<RpcAgent> agent;
  {
    absl::MutexLock lock(&g_mu);
    agent = g_agent;
  }
  if (!agent) return;
  agent->shutdown(graceful);
  absl::MutexLock lock(&g_mu);
  if (g_agent == agent) g_agent.reset();
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

}  // namespace ddprpc::rpc
