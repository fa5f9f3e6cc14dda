#include "rpc/rref/class_registry.h"

#include <stdexcept>

namespace ddprpc::rpc {

ClassRegistry& ClassRegistry::global() {
  static auto* registry = new ClassRegistry();
  return *registry;
}

ClassInfo* ClassRegistry::add(const std::string& name, std::type_index type) {
  absl::MutexLock lock(&mu_);
  if (by_name_.count(name) || by_type_.count(type)) {
    throw std::invalid_argument("rpc class '" + name + "' is already registered");
  }
  auto info = std::make_unique<ClassInfo>();
  info->name = name;
  info->type = type;
  ClassInfo* raw = info.get();
  by_name_[name] = std::move(info);
  by_type_[type] = raw;
  return raw;
}

const ClassInfo* ClassRegistry::find(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second.get();
}

const ClassInfo* ClassRegistry::find(std::type_index type) const {
  absl::MutexLock lock(&mu_);
  auto it = by_type_.find(type);
  return it == by_type_.end() ? nullptr : it->second;
}

namespace internal {

const std::string& class_name_of(std::type_index type) {
  const ClassInfo* info = ClassRegistry::global().find(type);
  if (!info) {
    throw RpcError(ErrorCode::kInvalidArgument,
                   std::string("class ") + type.name() +
                       " is not registered (use rpc::register_class)");
  }
  return info->name;
}

const std::string& method_name_of(std::type_index type, const std::string& key) {
  const ClassInfo* info = ClassRegistry::global().find(type);
  if (!info) class_name_of(type);  // throws
  auto it = info->method_names.find(key);
  if (it == info->method_names.end()) {
    throw RpcError(ErrorCode::kInvalidArgument,
                   "method of class '" + info->name + "' is not registered (add .method(...))");
  }
  return it->second;
}

}  // namespace internal
}  // namespace ddprpc::rpc
