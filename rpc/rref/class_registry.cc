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

ValueMethodRegistry& ValueMethodRegistry::global() {
  static auto* registry = new ValueMethodRegistry();
  return *registry;
}

void ValueMethodRegistry::add(const std::string& name, size_t arity, Handler handler) {
  absl::MutexLock lock(&mu_);
  auto& slot = methods_[name][arity];
  if (slot) {
    throw std::invalid_argument(absl::StrCat("value method '", name, "' with ", arity,
                                             " parameters is already registered"));
  }
  slot = std::make_unique<Handler>(std::move(handler));
}

const Handler* ValueMethodRegistry::find(const std::string& name, size_t arity) const {
  absl::MutexLock lock(&mu_);
  auto it = methods_.find(name);
  if (it == methods_.end()) return nullptr;
  auto one = it->second.find(arity);
  return one == it->second.end() ? nullptr : one->second.get();
}

std::vector<size_t> ValueMethodRegistry::arities(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  std::vector<size_t> out;
  auto it = methods_.find(name);
  if (it != methods_.end()) {
    for (const auto& [arity, handler] : it->second) out.push_back(arity);
  }
  return out;
}

namespace {

// at::Tensor's common methods, for RRef<at::Tensor>.
const bool kTensorMethods = [] {
  using at::Tensor;
  register_value_method("size", [](const Tensor& t) { return t.sizes().vec(); });
  register_value_method("size", [](const Tensor& t, int64_t dim) { return t.size(dim); });
  register_value_method("dim", [](const Tensor& t) { return t.dim(); });
  register_value_method("numel", [](const Tensor& t) { return t.numel(); });
  register_value_method("item", [](const Tensor& t) { return t.item<double>(); });
  register_value_method("sum", [](const Tensor& t) { return t.sum(); });
  register_value_method("sum", [](const Tensor& t, int64_t dim) { return t.sum(dim); });
  register_value_method("mean", [](const Tensor& t) { return t.mean(); });
  register_value_method("view",
                        [](const Tensor& t, std::vector<int64_t> shape) { return t.view(shape); });
  register_value_method("reshape",
                        [](const Tensor& t, std::vector<int64_t> shape) { return t.reshape(shape); });
  register_value_method("t", [](const Tensor& t) { return t.t(); });
  register_value_method("clone", [](const Tensor& t) { return t.clone(); });
  register_value_method("contiguous", [](const Tensor& t) { return t.contiguous(); });
  register_value_method("add", [](const Tensor& t, Tensor other) { return t.add(other); });
  register_value_method("mul", [](const Tensor& t, Tensor other) { return t.mul(other); });
  register_value_method("matmul", [](const Tensor& t, Tensor other) { return t.matmul(other); });
  register_value_method("narrow", [](const Tensor& t, int64_t dim, int64_t start, int64_t length) {
    return t.narrow(dim, start, length);
  });
  register_value_method("index_select", [](const Tensor& t, int64_t dim, Tensor index) {
    return t.index_select(dim, index);
  });
  return true;
}();

}  // namespace

namespace internal {

std::string object_type_name(std::type_index type) {
  (void)kTensorMethods;
  const ClassInfo* info = ClassRegistry::global().find(type);
  return info ? info->name : std::string("~") + type.name();
}

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
