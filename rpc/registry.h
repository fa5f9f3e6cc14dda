// The function registry: C++ functions callable by name over RPC.
//
//   at::Tensor add(at::Tensor a, at::Tensor b) { return a + b; }
//   DDPRPC_REGISTER_FUNCTION(add);                    // registered as "add"
//   rpc::register_function("scale", [](at::Tensor t, double k) { return t * k; });
//
// Parameters and the result use rpc::ValueTraits (value.h). A function that
// returns rpc::Future<R> runs with async execution: the worker thread is
// released at once and the reply is sent when the future completes.
// Argument count and types are checked at the callee; mismatches fail the
// call with ErrorCode::kInvalidArgument naming the argument.
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "rpc/core/errors.h"
#include "rpc/core/future.h"
#include "rpc/core/value.h"

namespace ddprpc::rpc {

// Type-erased form of a registered function.
using Handler = std::function<Future<c10::IValue>(std::vector<c10::IValue>& args)>;

namespace internal {

template <typename F>
struct FunctionTraits : FunctionTraits<decltype(&F::operator())> {};
template <typename R, typename... A>
struct FunctionTraits<R (*)(A...)> {
  using result = R;
  using args = std::tuple<std::decay_t<A>...>;
};
template <typename R, typename... A>
struct FunctionTraits<R(A...)> : FunctionTraits<R (*)(A...)> {};
template <typename C, typename R, typename... A>
struct FunctionTraits<R (C::*)(A...) const> : FunctionTraits<R (*)(A...)> {};
template <typename C, typename R, typename... A>
struct FunctionTraits<R (C::*)(A...)> : FunctionTraits<R (*)(A...)> {};

template <typename T>
struct Tag {
  using type = T;
};

template <typename Args, size_t... I>
Args convert_args(const std::string& name, std::vector<c10::IValue>& args,
                  std::index_sequence<I...>) {
  [[maybe_unused]] auto one = [&](auto tag, size_t index) {  // unused when there are no args
    using T = typename decltype(tag)::type;
    try {
      return ValueTraits<T>::from_ivalue(args[index]);
    } catch (const TypeMismatch& e) {
      throw RpcError(ErrorCode::kInvalidArgument,
                     absl::StrCat("argument ", index + 1, " of '", name, "': ", e.what()));
    }
  };
  return Args{one(Tag<std::tuple_element_t<I, Args>>{}, I)...};
}

template <typename R>
Future<c10::IValue> result_to_future(R&& result) {
  using T = std::decay_t<R>;
  if constexpr (IsFuture<T>::value) {
    return result.then([](const T& f) -> c10::IValue {
      if constexpr (std::is_void_v<typename T::value_type>) {
        f.wait();
        return c10::IValue();
      } else {
        return to_ivalue(f.value());
      }
    });
  } else {
    return make_ready_future(to_ivalue(std::forward<R>(result)));
  }
}

}  // namespace internal

// Wraps a typed C++ callable as a Handler that checks and converts arguments.
template <typename F>
Handler make_handler(std::string name, F fn) {
  using Traits = internal::FunctionTraits<std::decay_t<F>>;
  using Args = typename Traits::args;
  using R = typename Traits::result;
  return [name = std::move(name), fn = std::move(fn)](std::vector<c10::IValue>& args) {
    constexpr size_t n = std::tuple_size_v<Args>;
    if (args.size() != n) {
      throw RpcError(ErrorCode::kInvalidArgument,
                     absl::StrCat("'", name, "' takes ", n, " argument", n == 1 ? "" : "s",
                                  ", got ", args.size()));
    }
    Args typed = internal::convert_args<Args>(name, args, std::make_index_sequence<n>{});
    if constexpr (std::is_void_v<R>) {
      std::apply(fn, std::move(typed));
      return make_ready_future(c10::IValue());
    } else {
      return internal::result_to_future(std::apply(fn, std::move(typed)));
    }
  };
}

class FunctionRegistry {
 public:
  // The process-wide registry that DDPRPC_REGISTER_FUNCTION fills.
  static FunctionRegistry& global();

  // Throws std::invalid_argument if `name` is already registered.
  void add(const std::string& name, Handler handler);
  // nullptr when absent. Handlers are never removed, so the pointer stays valid.
  const Handler* find(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<Handler>> handlers_ ABSL_GUARDED_BY(mu_);
};

// Registers `fn` under `name` in the global registry.
template <typename F>
void register_function(const std::string& name, F fn) {
  FunctionRegistry::global().add(name, make_handler(name, std::move(fn)));
}

namespace internal {
struct Registrar {
  template <typename F>
  Registrar(const char* name, F fn) {
    register_function(name, std::move(fn));
  }
};
}  // namespace internal

}  // namespace ddprpc::rpc

// Registers the function `fn` under its own name at static initialization.
#define DDPRPC_REGISTER_FUNCTION(fn) \
  static ::ddprpc::rpc::internal::Registrar ddprpc_registrar_##fn(#fn, fn)

// Registers `fn` (any callable) under the string `name`.
#define DDPRPC_REGISTER_FUNCTION_AS(id, name, fn) \
  static ::ddprpc::rpc::internal::Registrar ddprpc_registrar_##id(name, fn)
