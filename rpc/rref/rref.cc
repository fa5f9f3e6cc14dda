#include "rpc/rref/rref.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "rpc/extension.h"
#include "rpc/rref/internal/rref_context.h"

namespace ddprpc::rpc {
namespace internal {
namespace {

// Every agent of a process that links RRefs serves their protocol.
const bool kRegistered = [] {
  register_agent_extension(
      RRefContext::kExtensionName,
      [](RpcAgent& agent, int rank, int world_size, const FunctionRegistry* user_functions) {
        return std::make_shared<RRefContext>(&agent, rank, world_size, user_functions);
      });
  return true;
}();

RRefContext& context_of(RpcAgent& agent) {
  auto* context = dynamic_cast<RRefContext*>(agent.extension(RRefContext::kExtensionName).get());
  if (!context) {
    throw RpcError(ErrorCode::kInternal,
                   absl::StrCat("worker '", agent.self().name, "' has no RRef extension"));
  }
  return *context;
}

}  // namespace

std::shared_ptr<RRefState> rref_create_local(RpcAgent& agent, c10::IValue value) {
  return context_of(agent).create_local(std::move(value));
}

std::shared_ptr<RRefState> rref_create_local_object(RpcAgent& agent, std::shared_ptr<void> object,
                                                   std::type_index type) {
  return context_of(agent).create_local_object(std::move(object), object_type_name(type));
}

std::shared_ptr<RRefState> rref_create_object(RpcAgent& agent, int to, const std::string& cls,
                                              std::vector<c10::IValue> args,
                                              absl::Duration timeout) {
  return context_of(agent).create_object(to, cls, std::move(args), timeout);
}

std::shared_ptr<RRefState> rref_create_value(RpcAgent& agent, int to, const std::string& function,
                                             std::vector<c10::IValue> args,
                                             absl::Duration timeout) {
  return context_of(agent).create_value(to, function, std::move(args), timeout);
}

std::shared_ptr<RRefState> rref_create_method_value(RpcAgent& agent, const RRefState& target,
                                                    const std::string& method,
                                                    std::vector<c10::IValue> args,
                                                    absl::Duration timeout) {
  return context_of(agent).create_method_value(target, method, std::move(args), timeout);
}

Future<c10::IValue> rref_fetch(RpcAgent& agent, const RRefState& rref, absl::Duration timeout) {
  return context_of(agent).fetch(rref, timeout);
}

Future<c10::IValue> rref_call_method(RpcAgent& agent, const RRefState& rref,
                                     const std::string& method, std::vector<c10::IValue> args,
                                     absl::Duration timeout) {
  return context_of(agent).call_method(rref, method, std::move(args), timeout);
}

Future<c10::IValue> rref_local_value(RpcAgent& agent, const RRefState& rref) {
  return context_of(agent).local_value(rref);
}

std::shared_ptr<void> rref_local_object(RpcAgent& agent, const RRefState& rref) {
  return context_of(agent).local_object(rref);
}

}  // namespace internal

int64_t rrefs_alive_at_shutdown(RpcAgent& agent) {
  return internal::context_of(agent).alive_at_shutdown();
}

size_t owned_rrefs(RpcAgent& agent) { return internal::context_of(agent).owned_count(); }

int64_t release_forks_held_by(const std::string& worker) {
  auto agent = current_agent();
  const int id = agent->worker(worker).id;
  if (id == agent->self().id) {
    throw RpcError(ErrorCode::kInvalidArgument,
                   "release_forks_held_by: '" + worker + "' is this worker itself");
  }
  return static_cast<int64_t>(internal::context_of(*agent).release_forks_held_by(id));
}

}  // namespace ddprpc::rpc
