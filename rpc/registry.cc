#include "rpc/registry.h"

#include <stdexcept>

namespace ddprpc::rpc {

FunctionRegistry& FunctionRegistry::global() {
  static auto* registry = new FunctionRegistry();
  return *registry;
}

void FunctionRegistry::add(const std::string& name, Handler handler) {
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = handlers_.emplace(name, nullptr);
  if (!inserted) {
    throw std::invalid_argument("rpc function '" + name + "' is already registered");
  }
  it->second = std::make_unique<Handler>(std::move(handler));
}

const Handler* FunctionRegistry::find(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = handlers_.find(name);
  return it == handlers_.end() ? nullptr : it->second.get();
}

std::vector<std::string> FunctionRegistry::names() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const auto& [name, handler] : handlers_) out.push_back(name);
  return out;
}

}  // namespace ddprpc::rpc
