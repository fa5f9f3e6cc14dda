// ddprpc's RPC API, mirroring torch.distributed.rpc:
//
//   rpc::init_rpc("worker0", rank, world_size);        // or from env vars
//   auto y = rpc::rpc_sync<at::Tensor>("worker1", "add", x, x);
//   rpc::Future<at::Tensor> f = rpc::rpc_async<at::Tensor>("worker1", "add", x, x);
//   rpc::shutdown();
//
// Functions are registered by name (registry.h); arguments and results are
// converted with rpc::ValueTraits (value.h). Every failure is an RpcError
// naming the worker and the function. The process holds one current agent,
// installed by init_rpc; RpcAgent can also be used directly.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rpc/agent.h"
#include "rpc/core/errors.h"
#include "rpc/core/future.h"
#include "rpc/registry.h"
#include "rpc/core/value.h"

namespace ddprpc::rpc {

// The gRPC settings the transport is fastest with, as the environment
// variables gRPC reads when it starts: the "poll" engine, with which the
// thread waiting for a reply reads its socket itself (no hop through
// another gRPC thread, ~40 us per message on small VMs); a 500 ms backup
// poller that keeps idle connections answering keepalive pings under it;
// and gRPC's tcp_read_chunks experiment off, so that a connection reads
// into one buffer of at least 256 KiB instead of 64 KiB slices (a message
// that straddles two slices has its reader send a WINDOW_UPDATE on its own,
// before the reply: ~8 us of a 64 KiB round trip between hosts; a gRPC
// without that experiment logs its name as unknown and goes on).
// They change gRPC for everything in the process, so the library never sets
// them: a program that wants them exports them, or sets them first thing in
// main, before anything uses gRPC (the benchmarks do, keeping values
// already in the environment).
struct GrpcEnvironmentSetting {
  const char* name;
  const char* value;
};
inline constexpr GrpcEnvironmentSetting kLowLatencyGrpcEnvironment[] = {
    {"GRPC_POLL_STRATEGY", "poll"},
    {"GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "500"},
    {"GRPC_EXPERIMENTS", "-tcp_read_chunks"},
};

// rank / world_size < 0: read RANK / WORLD_SIZE from the environment.
void init_rpc(const std::string& name, int rank = -1, int world_size = -1,
              RpcBackendOptions options = {});
// See RpcAgent::shutdown: true when a graceful shutdown met every worker.
bool shutdown(bool graceful = true);

// The current agent; throws RpcError(kShutdown) when RPC is not initialized.
std::shared_ptr<RpcAgent> current_agent();

WorkerInfo get_worker_info();
WorkerInfo get_worker_info(const std::string& name);
std::vector<WorkerInfo> get_worker_infos();

// Counters of this worker in one map, like torch.distributed.rpc's
// _get_debug_info: the agent's and RRefs' (RpcAgent::debug_info) and those
// of every layer that registered a source (dist_autograd: its contexts).
std::map<std::string, std::string> get_debug_info();
// Adds a source of counters to get_debug_info (for layers above rpc).
void register_debug_info(std::function<void(std::map<std::string, std::string>*)> source);

// The current agent's default call deadline (RpcAgent::rpc_timeout), like
// torch.distributed.rpc's get_rpc_timeout / _set_rpc_timeout.
absl::Duration get_rpc_timeout();
void set_rpc_timeout(absl::Duration timeout);

// Collectives among workers through the job's store, like
// torch.distributed.rpc's _barrier and _all_gather. Every worker named in
// `workers` (every worker when empty; the caller must be one of them) makes
// the same sequence of calls with that set of workers. Each call returns
// once all of them have made it, or throws RpcError(kTimeout) naming the
// workers still missing after `timeout`.
void barrier(const std::vector<std::string>& workers = {},
             absl::Duration timeout = absl::Seconds(60));
// Every named worker's `value`, by worker name.
std::map<std::string, std::string> all_gather(const std::string& value,
                                              const std::vector<std::string>& workers = {},
                                              absl::Duration timeout = absl::Seconds(60));

// The callee of a call: a worker's name, its rank (worker id) or its
// WorkerInfo, as torch.distributed.rpc's `to` accepts.
class WorkerRef {
 public:
  WorkerRef(const std::string& name) : name_(name) {}  // NOLINT: implicit by design
  WorkerRef(const char* name) : name_(name) {}         // NOLINT
  WorkerRef(int rank) : rank_(rank) {}                 // NOLINT
  WorkerRef(const WorkerInfo& info) : name_(info.name), rank_(info.id) {}  // NOLINT
  // The worker on `agent`; throws RpcError(kInvalidArgument) if it has none
  // by that name or rank (or a WorkerInfo whose name and id disagree).
  const WorkerInfo& resolve(const RpcAgent& agent) const;

 private:
  std::string name_;
  int rank_ = -1;
};

// Collects the futures of the rpc_async calls this thread makes while it
// exists (the innermost one, when nested), like PyTorch's
// `with rpc.api._wait_all():` block. wait() waits for them and throws the
// first error (as wait_all); the destructor waits for those still running
// and logs their errors, since it must not throw.
class WaitAllScope {
 public:
  WaitAllScope();
  ~WaitAllScope();
  WaitAllScope(const WaitAllScope&) = delete;
  WaitAllScope& operator=(const WaitAllScope&) = delete;
  void wait();
  size_t size() const { return futures_.size(); }

 private:
  friend void note_rpc_async(const Future<c10::IValue>& future);
  std::vector<Future<c10::IValue>> futures_;
  WaitAllScope* const previous_;
};
// Adds `future` to this thread's innermost WaitAllScope, if any.
void note_rpc_async(const Future<c10::IValue>& future);

// Per-call options, passed as the first argument:
//   rpc::rpc_sync<int64_t>(rpc::CallOptions{absl::Seconds(1)}, "w1", "f", 3);
struct CallOptions {
  absl::Duration timeout = kDefaultTimeout;  // zero: no deadline
};

namespace internal {

template <typename R>
Future<R> typed_future(Future<c10::IValue> raw) {
  if constexpr (std::is_same_v<R, c10::IValue>) {
    return raw;
  } else {
    return raw.then([](const Future<c10::IValue>& f) -> R {
      const c10::IValue& v = f.value();
      if constexpr (std::is_void_v<R>) {
        return;
      } else {
        try {
          return ValueTraits<R>::from_ivalue(v);
        } catch (const TypeMismatch& e) {
          throw RpcError(ErrorCode::kInvalidArgument,
                         std::string("unexpected result type: ") + e.what());
        }
      }
    });
  }
}

template <typename... Args>
std::vector<c10::IValue> pack_args(Args&&... args) {
  std::vector<c10::IValue> out;
  out.reserve(sizeof...(Args));
  (out.push_back(to_ivalue(std::forward<Args>(args))), ...);
  return out;
}

}  // namespace internal

// Calls `function` on worker `to` without blocking.
template <typename R = c10::IValue, typename... Args>
Future<R> rpc_async(const CallOptions& options, const WorkerRef& to,
                    const std::string& function, Args&&... args) {
  std::shared_ptr<RpcAgent> agent;
  try {
    agent = current_agent();
  } catch (const RpcError& e) {
    Future<R> f;
    f.set_error(e);
    return f;
  }
  Future<c10::IValue> raw;
  try {
    raw = agent->call(to.resolve(*agent).id, function,
                      internal::pack_args(std::forward<Args>(args)...), options.timeout,
                      "rpc_async");
  } catch (const RpcError& e) {
    raw.set_error(e);
  }
  note_rpc_async(raw);
  return internal::typed_future<R>(std::move(raw));
}

template <typename R = c10::IValue, typename... Args>
Future<R> rpc_async(const WorkerRef& to, const std::string& function, Args&&... args) {
  return rpc_async<R>(CallOptions{}, to, function, std::forward<Args>(args)...);
}

// Calls `function` on worker `to` and blocks for the result; throws RpcError.
template <typename R = c10::IValue, typename... Args>
R rpc_sync(const CallOptions& options, const WorkerRef& to, const std::string& function,
           Args&&... args) {
  std::shared_ptr<RpcAgent> agent = current_agent();
  SyncCallScope waits_at_once;
  const WorkerInfo& callee = to.resolve(*agent);
  Future<c10::IValue> raw = agent->call(callee.id, function,
                                        internal::pack_args(std::forward<Args>(args)...),
                                        options.timeout, "rpc_sync");
  const c10::IValue& value = raw.value();
  if constexpr (std::is_void_v<R>) {
    return;
  } else if constexpr (std::is_same_v<R, c10::IValue>) {
    return value;
  } else {
    try {
      return ValueTraits<R>::from_ivalue(value);
    } catch (const TypeMismatch& e) {
      throw RpcError(ErrorCode::kInvalidArgument,
                     "rpc_sync('" + function + "') on worker '" + callee.name +
                         "': unexpected result type: " + e.what());
    }
  }
}

template <typename R = c10::IValue, typename... Args>
R rpc_sync(const WorkerRef& to, const std::string& function, Args&&... args) {
  return rpc_sync<R>(CallOptions{}, to, function, std::forward<Args>(args)...);
}

}  // namespace ddprpc::rpc
