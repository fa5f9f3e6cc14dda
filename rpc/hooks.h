// Hooks into every RPC message, for layers above rpc (distributed autograd
// attaches its send/recv functions and context ids here; the profiler its
// events). Any number of hooks may be installed; each sees every message, in
// the order they were added. Hooks run on RPC threads and must not block.
// They must not throw, except incoming_request() and incoming_response(),
// which refuse a message (its key/value pairs came from a peer) by throwing
// RpcError: the request, or the call, then fails with it. With no hook
// installed the agent pays one atomic load per message.
#pragma once

#include <ATen/core/ivalue.h>

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "rpc/worker.h"

namespace ddprpc::rpc {

// Key/value pairs that hooks attach to a message. Messages carry a few, so
// they are kept in order in a vector (as they travel), found by a scan.
class MessageExt {
 public:
  using Entry = std::pair<std::string, std::string>;
  using const_iterator = std::vector<Entry>::const_iterator;

  const_iterator begin() const { return entries_.begin(); }
  const_iterator end() const { return entries_.end(); }
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }
  // The entry of `key`, or end().
  const_iterator find(std::string_view key) const {
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->first == key) return it;
    }
    return entries_.end();
  }
  // The value of `key`, added empty if absent.
  std::string& operator[](std::string_view key) {
    for (auto& e : entries_) {
      if (e.first == key) return e.second;
    }
    return entries_.emplace_back(std::string(key), std::string()).second;
  }
  // Appends an entry as received (a repeated key is kept; find() sees the first).
  void append(std::string key, std::string value) {
    entries_.emplace_back(std::move(key), std::move(value));
  }

 private:
  std::vector<Entry> entries_;
};

// A call (not a one-way notice) as the caller's hooks see it.
struct OutgoingCall {
  const WorkerInfo& from;
  const WorkerInfo& to;
  const std::string& function;  // registered function name
  const char* api;              // "rpc_sync", "rpc_async", "remote", ...
  const std::string& display;   // as shown in errors (function, or e.g. "Table.forward")
};

class RpcHook {
 public:
  virtual ~RpcHook() = default;
  // Caller: a call is about to be encoded and sent. The returned state (may
  // be null) comes back to end_call() exactly once.
  virtual std::shared_ptr<void> start_call(const OutgoingCall& call, MessageExt* ext) {
    return nullptr;
  }
  // Caller: the call ended, on the thread completing it, just before its
  // future completes. `reply` is the response's ext, or nullptr when the call
  // failed (error reply, timeout, broken connection, shutdown).
  virtual void end_call(const std::shared_ptr<void>& call_state, const MessageExt* reply) {}
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
  // This worker found `worker` unreachable (its connection failed: reset,
  // refused, or silent past the keepalive timeout; not a worker that closed
  // its connection on shutdown), with `why`. Once per worker and agent, on
  // the thread that found it; the calls pending on it fail after this.
  virtual void worker_unreachable(const WorkerInfo& worker, const std::string& why) {}
};

using RpcHooks = std::vector<std::shared_ptr<RpcHook>>;

// Adds a hook for the rest of the process (hooks are never removed).
void add_rpc_hook(std::shared_ptr<RpcHook> hook);
// The hooks installed now. The list is immutable and lives for the whole
// process; a later add_rpc_hook publishes a new list.
const RpcHooks& rpc_hooks();

}  // namespace ddprpc::rpc
