// Who takes part in a job, and which call this thread is serving: the
// plain facts shared by the caller's side (agent.h), the callee's side and
// the hooks (hooks.h).
#pragma once

#include <string>

#include "absl/time/time.h"

namespace ddprpc::rpc {

struct WorkerInfo {
  std::string name;
  int id = -1;
  std::string address;  // host:port of its RPC server
};

// What a callee knows about the request it is running.
struct CallContext {
  int caller = -1;       // worker id of the caller
  std::string function;  // registered function name
  absl::Time received;   // when it arrived (before waiting for a worker thread)
};

// The request being served on this thread, or nullptr outside a request.
const CallContext* current_call();

}  // namespace ddprpc::rpc
