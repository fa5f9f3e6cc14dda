// Remote references, mirroring torch.distributed.rpc.RRef:
//
//   auto table = rpc::remote<EmbeddingTable>("ps0", 1000, 16);   // T on ps0
//   at::Tensor y = table.rpc_sync(&EmbeddingTable::forward, idx, offsets);
//   auto sum = rpc::remote<at::Tensor>("ps0", "add", a, b);        // function result
//   at::Tensor s = sum.to_here();
//   rpc::RRef<at::Tensor> p(param);                                 // local owner RRef
//   auto n = sum.rpc_sync<int64_t>("numel");                        // a value's method
//   rpc::RRef<Model> m(std::make_shared<Model>());                  // local object
//
// Creation is asynchronous: remote() returns at once, and a creation error
// surfaces at the next use (to_here, a method call) with the owner's
// message. RRefs can be passed to and returned from any RPC; the owner
// destroys the value when the last reference anywhere is gone. Method calls
// are type-checked at compile time against the member function; the class
// and its methods must be registered (class_registry.h). Methods can also be
// called by name, with the result type given: a registered class's, or for
// an RRef of a value, a value method (register_value_method; tensors come
// with at::Tensor's common ones). A local owner RRef of an object needs no
// registration, but then only its owner can use the object (local_value()).
#pragma once

#include <memory>
#include <string>
#include <type_traits>
#include <typeindex>
#include <typeinfo>
#include <utility>

#include "absl/time/time.h"
#include "rpc/rpc.h"
#include "rpc/rref/class_registry.h"
#include "rpc/rref/rref_state.h"

namespace ddprpc::rpc {

namespace internal {

template <typename T, typename = void>
struct IsValueType : std::false_type {};
template <typename T>
struct IsValueType<T, std::void_t<decltype(ValueTraits<T>::from_ivalue(
                          std::declval<const c10::IValue&>()))>> : std::true_type {};

template <typename T>
struct UnwrapFuture {
  using type = T;
};
template <typename T>
struct UnwrapFuture<Future<T>> {
  using type = T;
};

// The RRef extension of `agent` (defined in rref.cc); each throws RpcError.
std::shared_ptr<RRefState> rref_create_local(RpcAgent& agent, c10::IValue value);
std::shared_ptr<RRefState> rref_create_local_object(RpcAgent& agent, std::shared_ptr<void> object,
                                                   std::type_index type);
std::shared_ptr<RRefState> rref_create_object(RpcAgent& agent, int to, const std::string& cls,
                                              std::vector<c10::IValue> args,
                                              absl::Duration timeout);
std::shared_ptr<RRefState> rref_create_value(RpcAgent& agent, int to, const std::string& function,
                                             std::vector<c10::IValue> args,
                                             absl::Duration timeout);
std::shared_ptr<RRefState> rref_create_method_value(RpcAgent& agent, const RRefState& target,
                                                    const std::string& method,
                                                    std::vector<c10::IValue> args,
                                                    absl::Duration timeout);
Future<c10::IValue> rref_fetch(RpcAgent& agent, const RRefState& rref, absl::Duration timeout);
Future<c10::IValue> rref_call_method(RpcAgent& agent, const RRefState& rref,
                                     const std::string& method, std::vector<c10::IValue> args,
                                     absl::Duration timeout);
Future<c10::IValue> rref_local_value(RpcAgent& agent, const RRefState& rref);
std::shared_ptr<void> rref_local_object(RpcAgent& agent, const RRefState& rref);

}  // namespace internal

template <typename T>
class RRef {
 public:
  static constexpr bool kIsValue = internal::IsValueType<T>::value;

  RRef() = default;
  explicit RRef(std::shared_ptr<internal::RRefState> state) : state_(std::move(state)) {}

  // An RRef owned by this worker holding `value` (values only, not objects).
  template <typename U = T, typename = std::enable_if_t<internal::IsValueType<U>::value>>
  explicit RRef(U value) {
    auto agent = current_agent();
    state_ = internal::rref_create_local(*agent, to_ivalue(std::move(value)));
  }
  // An RRef owned by this worker of `object` (objects; T need not be
  // registered unless other workers call its methods).
  template <typename U = T, typename = std::enable_if_t<!internal::IsValueType<U>::value>>
  explicit RRef(std::shared_ptr<U> object) {
    auto agent = current_agent();
    state_ = internal::rref_create_local_object(*agent, std::move(object), typeid(T));
  }

  bool defined() const { return state_ != nullptr; }
  WorkerInfo owner() const { return current_agent()->worker(state().owner); }
  std::string owner_name() const { return owner().name; }
  bool is_owner() const { return current_agent()->self().id == state().owner; }
  // True once the owner has acknowledged this reference (for the creator:
  // the value or object exists, or its creation failed).
  bool confirmed_by_owner() const { return state().created.completed(); }

  // Copies the value here (values only; objects stay on their owner).
  template <typename U = T, typename = std::enable_if_t<internal::IsValueType<U>::value>>
  U to_here(absl::Duration timeout = kDefaultTimeout) const {
    auto agent = current_agent();
    if (is_owner()) return from_value(internal::rref_local_value(*agent, state()).value());
    SyncCallScope waits_at_once;
    return from_value(internal::rref_fetch(*agent, state(), timeout).value());
  }

  // On the owner: the value itself (a tensor shares its storage), or a
  // pointer to the object. Elsewhere: RpcError(kInvalidArgument).
  auto local_value() const {
    auto agent = current_agent();
    if (!is_owner()) {
      throw RpcError(ErrorCode::kInvalidArgument,
                     "RRef::local_value() called on worker '" + agent->self().name +
                         "' but the owner is '" + agent->worker(state().owner).name + "'");
    }
    if constexpr (kIsValue) {
      return from_value(internal::rref_local_value(*agent, state()).value());
    } else {
      return std::static_pointer_cast<T>(internal::rref_local_object(*agent, state()));
    }
  }

  // Calls `method` on the object at its owner; with CallOptions first, under
  // that call's timeout instead of the agent's rpc_timeout.
  template <typename M, typename... A,
            typename = std::enable_if_t<std::is_member_function_pointer_v<M>>>
  auto rpc_async(M method, A&&... args) const {
    return rpc_async(CallOptions{}, method, std::forward<A>(args)...);
  }
  template <typename M, typename... A>
  auto rpc_async(const CallOptions& options, M method, A&&... args) const {
    using R = typename internal::UnwrapFuture<typename internal::FunctionTraits<M>::result>::type;
    static_assert(std::is_invocable_v<M, T&, A...>,
                  "RRef<T>::rpc_*: the arguments do not match the method's parameters");
    return internal::typed_future<R>(call_method(
        options, [method] { return internal::method_name_of(typeid(T), internal::member_key(method)); },
        std::forward<A>(args)...));
  }

  template <typename M, typename... A,
            typename = std::enable_if_t<std::is_member_function_pointer_v<M>>>
  auto rpc_sync(M method, A&&... args) const {
    return rpc_sync(CallOptions{}, method, std::forward<A>(args)...);
  }
  template <typename M, typename... A>
  auto rpc_sync(const CallOptions& options, M method, A&&... args) const {
    SyncCallScope waits_at_once;
    return rpc_async(options, method, std::forward<A>(args)...).value();
  }

  // Calls the method named `method` at the owner (see above) and converts
  // its result to R.
  template <typename R, typename... A>
  Future<R> rpc_async(const std::string& method, A&&... args) const {
    return rpc_async<R>(CallOptions{}, method, std::forward<A>(args)...);
  }
  template <typename R, typename... A>
  Future<R> rpc_async(const CallOptions& options, const std::string& method, A&&... args) const {
    return internal::typed_future<R>(
        call_method(options, [&method] { return method; }, std::forward<A>(args)...));
  }
  template <typename R, typename... A>
  R rpc_sync(const std::string& method, A&&... args) const {
    return rpc_sync<R>(CallOptions{}, method, std::forward<A>(args)...);
  }
  template <typename R, typename... A>
  R rpc_sync(const CallOptions& options, const std::string& method, A&&... args) const {
    SyncCallScope waits_at_once;
    return rpc_async<R>(options, method, std::forward<A>(args)...).value();
  }
  template <typename R, typename... A>
  RRef<R> remote(const std::string& method, A&&... args) const {
    return remote<R>(CallOptions{}, method, std::forward<A>(args)...);
  }
  template <typename R, typename... A>
  RRef<R> remote(const CallOptions& options, const std::string& method, A&&... args) const {
    static_assert(internal::IsValueType<R>::value, "RRef::remote<R>(name, ...): R is a value type");
    auto agent = current_agent();
    return RRef<R>(internal::rref_create_method_value(
        *agent, state(), method, internal::pack_args(std::forward<A>(args)...), options.timeout));
  }

  // Runs `method` on the owner and keeps its result there; with CallOptions
  // first, its creation fails (kTimeout) unless confirmed within the timeout.
  template <typename M, typename... A,
            typename = std::enable_if_t<std::is_member_function_pointer_v<M>>>
  auto remote(M method, A&&... args) const {
    return remote(CallOptions{}, method, std::forward<A>(args)...);
  }
  template <typename M, typename... A>
  auto remote(const CallOptions& options, M method, A&&... args) const {
    using R = typename internal::UnwrapFuture<typename internal::FunctionTraits<M>::result>::type;
    static_assert(std::is_invocable_v<M, T&, A...>,
                  "RRef<T>::remote: the arguments do not match the method's parameters");
    auto agent = current_agent();
    const std::string& name = internal::method_name_of(typeid(T), internal::member_key(method));
    return RRef<R>(internal::rref_create_method_value(
        *agent, state(), name, internal::pack_args(std::forward<A>(args)...), options.timeout));
  }

  const internal::RRefState& state() const {
    if (!state_) throw RpcError(ErrorCode::kInvalidArgument, "use of an empty RRef");
    return *state_;
  }
  const std::shared_ptr<internal::RRefState>& shared_state() const { return state_; }

 private:
  // Calls the method named by name() at the owner; an RpcError (an
  // unregistered method, a dead owner) fails the future instead of throwing.
  template <typename NameFn, typename... A>
  Future<c10::IValue> call_method(const CallOptions& options, NameFn name, A&&... args) const {
    auto agent = current_agent();
    Future<c10::IValue> raw;
    try {
      raw = internal::rref_call_method(*agent, state(), name(),
                                       internal::pack_args(std::forward<A>(args)...),
                                       options.timeout);
    } catch (const RpcError& e) {
      raw.set_error(e);
    }
    return raw;
  }

  static auto from_value(const c10::IValue& v) {
    if constexpr (kIsValue) {
      try {
        return ValueTraits<T>::from_ivalue(v);
      } catch (const TypeMismatch& e) {
        throw RpcError(ErrorCode::kInvalidArgument, std::string("RRef value: ") + e.what());
      }
    }
  }

  std::shared_ptr<internal::RRefState> state_;
};

template <typename T>
struct ValueTraits<RRef<T>> {
  static c10::IValue to_ivalue(const RRef<T>& rref) {
    return c10::IValue::make_capsule(c10::make_intrusive<internal::RRefCapsule>(rref.shared_state()));
  }
  static RRef<T> from_ivalue(const c10::IValue& v) {
    auto* holder = v.isCapsule() ? dynamic_cast<internal::RRefCapsule*>(v.toCapsule().get()) : nullptr;
    if (!holder) throw_type_mismatch("RRef", v);
    if constexpr (!RRef<T>::kIsValue) {
      const std::string expected = internal::object_type_name(typeid(T));
      if (holder->state->type != expected) {
        throw TypeMismatch("expected RRef of '" + expected + "', got RRef of " +
                           (holder->state->type.empty() ? "a value" : "'" + holder->state->type + "'"));
      }
    } else if (!holder->state->type.empty()) {
      throw TypeMismatch("expected RRef of a value, got RRef of '" + holder->state->type + "'");
    }
    return RRef<T>(holder->state);
  }
};

// rpc::remote<T>([options,] to, ctor_args...): creates a registered class
// T on `to`. With CallOptions, the creation fails (kTimeout, seen by
// to_here(), calls and confirmed_by_owner()) unless the owner confirms it within the
// timeout; without, within the agent's rpc_timeout.
template <typename T, typename... Args,
          typename = std::enable_if_t<!internal::IsValueType<T>::value>>
RRef<T> remote(const CallOptions& options, const WorkerRef& to, Args&&... args) {
  static_assert(std::is_constructible_v<T, std::decay_t<Args>...>,
                "rpc::remote<T>: T cannot be constructed from these arguments");
  auto agent = current_agent();
  return RRef<T>(internal::rref_create_object(
      *agent, to.resolve(*agent).id, internal::class_name_of(typeid(T)),
      internal::pack_args(std::forward<Args>(args)...), options.timeout));
}
template <typename T, typename... Args,
          typename = std::enable_if_t<!internal::IsValueType<T>::value>>
RRef<T> remote(const WorkerRef& to, Args&&... args) {
  return remote<T>(CallOptions{}, to, std::forward<Args>(args)...);
}

// rpc::remote<R>([options,] to, "function", args...): runs a registered
// function on `to` and keeps its result (of type R) there.
template <typename R, typename... Args,
          typename = std::enable_if_t<internal::IsValueType<R>::value>>
RRef<R> remote(const CallOptions& options, const WorkerRef& to, const std::string& function,
               Args&&... args) {
  auto agent = current_agent();
  return RRef<R>(internal::rref_create_value(
      *agent, to.resolve(*agent).id, function, internal::pack_args(std::forward<Args>(args)...),
      options.timeout));
}
template <typename R, typename... Args,
          typename = std::enable_if_t<internal::IsValueType<R>::value>>
RRef<R> remote(const WorkerRef& to, const std::string& function, Args&&... args) {
  return remote<R>(CallOptions{}, to, function, std::forward<Args>(args)...);
}

// RRefs `agent` still owned when its graceful shutdown had heard from every
// worker (0 unless some reference leaked); -1 before such a shutdown.
int64_t rrefs_alive_at_shutdown(RpcAgent& agent);
// RRefs `agent` owns now that are still referenced somewhere.
size_t owned_rrefs(RpcAgent& agent);

// For a worker gone for good (it crashed, or an elastic job removed it from
// its membership): the deletes of the RRefs it held will never come. This
// releases, on the current agent, every fork `worker` holds of the RRefs
// this worker owns, as if it had dropped them; values nothing else
// references go. Returns how many forks were released. Only for a worker
// that will not come back: handles it still had would name values that
// may be gone. PyTorch has no counterpart (its RPC group does not outlive
// a lost worker).
int64_t release_forks_held_by(const std::string& worker);

}  // namespace ddprpc::rpc
