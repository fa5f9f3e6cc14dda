#include "rpc/hooks.h"

#include <atomic>

namespace ddprpc::rpc {
namespace {
std::shared_ptr<RpcHook>& hook_slot() {
  static auto* slot = new std::shared_ptr<RpcHook>();
  return *slot;
}
}  // namespace

void set_rpc_hook(std::shared_ptr<RpcHook> hook) { std::atomic_store(&hook_slot(), std::move(hook)); }

std::shared_ptr<RpcHook> rpc_hook() { return std::atomic_load(&hook_slot()); }

}  // namespace ddprpc::rpc
