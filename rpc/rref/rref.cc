#include "rpc/rref.h"

namespace ddprpc::rpc::internal {

RRefContext& rref_context(const std::shared_ptr<RpcAgent>& agent) { return agent->rrefs(); }

}  // namespace ddprpc::rpc::internal
