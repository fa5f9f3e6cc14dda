#include "rpc/hooks.h"

#include <atomic>
#include <mutex>

namespace ddprpc::rpc {
namespace {
// Published lists are never freed: readers hold plain references to them.
std::atomic<const RpcHooks*> g_hooks{nullptr};
std::mutex g_add_mu;
}  // namespace

void add_rpc_hook(std::shared_ptr<RpcHook> hook) {
  if (!hook) return;
  std::lock_guard<std::mutex> lock(g_add_mu);
  const RpcHooks* old = g_hooks.load(std::memory_order_acquire);
  auto* next = new RpcHooks(old ? *old : RpcHooks{});
  next->push_back(std::move(hook));
  g_hooks.store(next, std::memory_order_release);
}

const RpcHooks& rpc_hooks() {
  static const RpcHooks* const kNone = new RpcHooks();
  const RpcHooks* hooks = g_hooks.load(std::memory_order_acquire);
  return hooks ? *hooks : *kNone;
}

}  // namespace ddprpc::rpc
