// Remote object types: classes whose instances rpc::remote<T> creates on
// another worker and whose methods RRef<T> calls.
//
//   class Table { public: Table(int64_t n, int64_t d); at::Tensor forward(at::Tensor i); };
//   static auto reg = rpc::register_class<Table>("Table")
//                         .constructor<int64_t, int64_t>()
//                         .method("forward", &Table::forward);
//
// Registration must be linked into every binary that creates or calls the
// class (as for functions). Arguments are checked on the owner like those of
// registered functions.
//
// Values (RRef<at::Tensor>, RRef<int64_t>, ...) have methods too: functions
// whose first parameter is the value, run by the owner on the value it
// holds, so that the value itself never travels.
//
//   rpc::register_value_method("row", [](const at::Tensor& t, int64_t i) { return t[i]; });
//   at::Tensor r = rref.rpc_sync<at::Tensor>("row", 3);
//
// A name may be registered once per number of parameters. Tensors come with
// size, dim, numel, item, sum, mean, view, reshape, t, clone, contiguous,
// add, mul, matmul, narrow and index_select, as at::Tensor's methods.
#pragma once

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <typeindex>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "rpc/registry.h"

namespace ddprpc::rpc {

using Constructor = std::function<std::shared_ptr<void>(std::vector<c10::IValue>& args)>;
using MethodHandler = std::function<Future<c10::IValue>(void* object, std::vector<c10::IValue>& args)>;

struct ClassInfo {
  std::string name;
  std::type_index type = typeid(void);
  Constructor constructor;
  std::map<std::string, MethodHandler> methods;
  // Member-function-pointer bytes -> method name, for RRef<T>::rpc_sync(&T::m, ...).
  std::map<std::string, std::string> method_names;
};

class ClassRegistry {
 public:
  static ClassRegistry& global();
  // Registers an empty class; throws std::invalid_argument on a duplicate.
  ClassInfo* add(const std::string& name, std::type_index type);
  // nullptr when absent; entries are never removed.
  const ClassInfo* find(const std::string& name) const;
  const ClassInfo* find(std::type_index type) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<ClassInfo>> by_name_ ABSL_GUARDED_BY(mu_);
  std::map<std::type_index, const ClassInfo*> by_type_ ABSL_GUARDED_BY(mu_);
};

// Methods of values (see above), by name and number of parameters (the
// value included); handlers take the value as their first argument.
class ValueMethodRegistry {
 public:
  static ValueMethodRegistry& global();
  // Throws std::invalid_argument on a duplicate (name, arity).
  void add(const std::string& name, size_t arity, Handler handler);
  // nullptr when absent; entries are never removed.
  const Handler* find(const std::string& name, size_t arity) const;
  // The arities registered under `name` (empty when none).
  std::vector<size_t> arities(const std::string& name) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::map<size_t, std::unique_ptr<Handler>>> methods_ ABSL_GUARDED_BY(mu_);
};

// Registers `fn`, whose first parameter is the value, as a method of values.
template <typename F>
void register_value_method(const std::string& name, F fn) {
  using Args = typename internal::FunctionTraits<std::decay_t<F>>::args;
  static_assert(std::tuple_size_v<Args> >= 1, "a value method takes the value first");
  ValueMethodRegistry::global().add(name, std::tuple_size_v<Args>,
                                    make_handler(name, std::move(fn)));
}

namespace internal {

// The name an RRef of an object carries: the registered class name, or for
// an unregistered class (a local owner RRef) "~" and the C++ type's name;
// such an RRef travels, but its methods cannot be called remotely.
std::string object_type_name(std::type_index type);

template <typename M>
std::string member_key(M method) {
  return std::string(reinterpret_cast<const char*>(&method), sizeof(method));
}

// The registered class name of T; throws RpcError(kInvalidArgument) if T is
// not registered.
const std::string& class_name_of(std::type_index type);
// The registered name of a method of T, by member pointer.
const std::string& method_name_of(std::type_index type, const std::string& key);

}  // namespace internal

// Builder returned by register_class<T>(name); the class is registered at
// once and the builder adds its constructor and methods (during static
// initialization, before any RPC runs).
template <typename T>
class ClassRegistrar {
 public:
  explicit ClassRegistrar(ClassInfo* info) : info_(info) {}

  template <typename... A>
  ClassRegistrar& constructor() {
    const std::string name = info_->name;
    info_->constructor = [name](std::vector<c10::IValue>& args) -> std::shared_ptr<void> {
      constexpr size_t n = sizeof...(A);
      if (args.size() != n) {
        throw RpcError(ErrorCode::kInvalidArgument,
                       absl::StrCat("constructor of '", name, "' takes ", n, " arguments, got ",
                                    args.size()));
      }
      auto typed = internal::convert_args<std::tuple<std::decay_t<A>...>>(
          name, args, std::make_index_sequence<n>{});
      return std::apply([](auto&&... a) { return std::make_shared<T>(std::move(a)...); },
                        std::move(typed));
    };
    return *this;
  }

  template <typename M>
  ClassRegistrar& method(const std::string& method_name, M method) {
    using Traits = internal::FunctionTraits<M>;
    using Args = typename Traits::args;
    using R = typename Traits::result;
    const std::string full = info_->name + "." + method_name;
    info_->methods[method_name] = [full, method](void* object, std::vector<c10::IValue>& args) {
      constexpr size_t n = std::tuple_size_v<Args>;
      if (args.size() != n) {
        throw RpcError(ErrorCode::kInvalidArgument,
                       absl::StrCat("'", full, "' takes ", n, " argument", n == 1 ? "" : "s",
                                    ", got ", args.size()));
      }
      Args typed = internal::convert_args<Args>(full, args, std::make_index_sequence<n>{});
      T* self = static_cast<T*>(object);
      auto call = [&](auto&&... a) -> R { return (self->*method)(std::move(a)...); };
      if constexpr (std::is_void_v<R>) {
        std::apply(call, std::move(typed));
        return make_ready_future(c10::IValue());
      } else {
        return internal::result_to_future(std::apply(call, std::move(typed)));
      }
    };
    info_->method_names[internal::member_key(method)] = method_name;
    return *this;
  }

 private:
  ClassInfo* info_;
};

template <typename T>
ClassRegistrar<T> register_class(const std::string& name) {
  return ClassRegistrar<T>(ClassRegistry::global().add(name, typeid(T)));
}

}  // namespace ddprpc::rpc
