#include "rpc/hooks.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

namespace ddprpc::rpc {
namespace {
// Published lists are never freed (readers hold plain references to them);
// every one stays reachable from g_published.
std::atomic<const RpcHooks*> g_hooks{nullptr};
std::mutex g_add_mu;
std::vector<std::unique_ptr<const RpcHooks>>* g_published = nullptr;  // guarded by g_add_mu
}  // namespace

void add_rpc_hook(std::shared_ptr<RpcHook> hook) {
  if (!hook) return;
  std::lock_guard<std::mutex> lock(g_add_mu);
  if (!g_published) g_published = new std::vector<std::unique_ptr<const RpcHooks>>();
  const RpcHooks* old = g_hooks.load(std::memory_order_acquire);
  auto next = std::make_unique<RpcHooks>(old ? *old : RpcHooks{});
  next->push_back(std::move(hook));
  g_hooks.store(next.get(), std::memory_order_release);
  g_published->push_back(std::move(next));
}

const RpcHooks& rpc_hooks() {
  static const RpcHooks* const kNone = new RpcHooks();
  const RpcHooks* hooks = g_hooks.load(std::memory_order_acquire);
  return hooks ? *hooks : *kNone;
}

}  // namespace ddprpc::rpc
