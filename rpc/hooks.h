// A hook into every RPC message, for layers above rpc (distributed autograd
// attaches its send/recv functions and context ids here). One hook per
// process; the default does nothing. Hooks run on RPC threads and must not
// block.
#pragma once

#include <ATen/core/ivalue.h>
#include <google/protobuf/map.h>

#include <memory>
#include <string>

namespace ddprpc::rpc {

using MessageExt = google::protobuf::Map<std::string, std::string>;

class RpcHook {
 public:
  virtual ~RpcHook() = default;
  // Caller: a request with `args` is about to go to worker `dest`.
  virtual void outgoing_request(int dest, const c10::IValue& args, MessageExt* ext) {}
  // Callee: a request arrived from `src`. The returned state (may be null)
  // comes back to enter() and outgoing_response() for this request.
  virtual std::shared_ptr<void> incoming_request(int src, const c10::IValue& args,
                                                 const MessageExt& ext) {
    return nullptr;
  }
  // Callee: the request's function is about to run on this thread; the
  // returned guard is destroyed when it returns.
  virtual std::shared_ptr<void> enter(const std::shared_ptr<void>& request_state) {
    return nullptr;
  }
  // Callee: the result is about to go back to `dest`.
  virtual void outgoing_response(int dest, const std::shared_ptr<void>& request_state,
                                 const c10::IValue& result, MessageExt* ext) {}
  // Caller: a response arrived from `src`.
  virtual void incoming_response(int src, const c10::IValue& result, const MessageExt& ext) {}
};

// Installs the process-wide hook (nullptr: none).
void set_rpc_hook(std::shared_ptr<RpcHook> hook);
std::shared_ptr<RpcHook> rpc_hook();

}  // namespace ddprpc::rpc
