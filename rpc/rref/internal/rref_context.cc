#include "rpc/rref/internal/rref_context.h"


#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "glog/logging.h"
#include "rpc/agent.h"
#include "rpc/rref/class_registry.h"

namespace ddprpc::rpc::internal {
namespace {

// The caller of the internal function running on this thread.
int caller_of_request() {
  const CallContext* call = current_call();
  if (!call) throw RpcError(ErrorCode::kInternal, "rref: no request is being served");
  return call->caller;
}

constexpr char kCreate[] = "__rref.create";
constexpr char kFetch[] = "__rref.fetch";
constexpr char kCall[] = "__rref.call";
constexpr char kAddFork[] = "__rref.add_fork";
constexpr char kDelFork[] = "__rref.del_fork";
constexpr char kRRefExtension[] = "rref";

RRefId make_id(int64_t worker, int64_t local) {
  return RRefId{static_cast<int32_t>(worker), local};
}

std::vector<c10::IValue> tuple_elements(const c10::IValue& v) {
  if (!v.isTuple()) throw RpcError(ErrorCode::kMalformedMessage, "rref: arguments are not a tuple");
  return v.toTupleRef().elements().vec();
}

c10::IValue as_tuple(std::vector<c10::IValue> args) {
  return c10::IValue(c10::ivalue::Tuple::create(std::move(args)));
}

// Runs `method` on what an owner entry holds: a registered class's method
// on its object, or a value method on its value (`ready` has completed).
Future<c10::IValue> invoke_method(const std::string& type, void* object,
                                  const Future<c10::IValue>& ready, const std::string& method,
                                  std::vector<c10::IValue>& args) {
  if (type.empty()) {
    c10::IValue value = ready.value();  // rethrows a failed creation
    const Handler* handler = ValueMethodRegistry::global().find(method, args.size() + 1);
    if (!handler) {
      std::vector<size_t> arities = ValueMethodRegistry::global().arities(method);
      if (arities.empty()) {
        throw RpcError(ErrorCode::kUnknownFunction,
                       "no value method '" + method + "' is registered (rpc::register_value_method)");
      }
      std::vector<std::string> counts;
      for (size_t a : arities) counts.push_back(std::to_string(a - 1));
      throw RpcError(ErrorCode::kInvalidArgument,
                     absl::StrCat("value method '", method, "' takes ", absl::StrJoin(counts, " or "),
                                  " arguments, got ", args.size()));
    }
    std::vector<c10::IValue> all;
    all.reserve(args.size() + 1);
    all.push_back(std::move(value));
    for (auto& a : args) all.push_back(std::move(a));
    return (*handler)(all);
  }
  ready.wait();
  const ClassInfo* info = ClassRegistry::global().find(type);
  if (!info) {
    throw RpcError(ErrorCode::kInvalidArgument,
                   "method '" + method + "' called on an RRef of an object of unregistered class " +
                       type.substr(1) + " (rpc::register_class to call its methods remotely)");
  }
  auto it = info->methods.find(method);
  if (it == info->methods.end()) {
    throw RpcError(ErrorCode::kUnknownFunction,
                   "class '" + type + "' has no method '" + method + "'");
  }
  return it->second(object, args);
}

}  // namespace

RRefState::~RRefState() {
  if (auto ctx = context.lock()) ctx->release(*this);
}

RRefContext::RRefContext(RpcAgent* agent, int self_id, int world_size,
                         const FunctionRegistry* user_functions)
    : self_id_(self_id), world_size_(world_size), user_functions_(user_functions), agent_(agent) {
  // The owner-side protocol, served by the agent like any function. Handlers
  // and the codec hold a raw pointer: the agent stops serving before the
  // context goes.
  RRefContext* self = this;
  codec_.type = kRRefExtension;
  codec_.claims_capsule = [](const c10::IValue& capsule) {
    return capsule.isCapsule() &&
           dynamic_cast<RRefCapsule*>(capsule.toCapsule().get()) != nullptr;
  };
  codec_.encode_capsule = [self](const c10::IValue& capsule, int dest, wire::Extension* out) {
    self->encode(capsule, dest, out);
  };
  codec_.decode_capsule = [self](const wire::Extension& ext, int src) {
    return self->decode(ext, src);
  };
  functions_.add(kCreate, make_handler(kCreate, [self](int64_t id_w, int64_t id_l, int64_t fork_w,
                                                        int64_t fork_l, std::string kind,
                                                        std::string name, int64_t target_w,
                                                        int64_t target_l, c10::IValue args) {
    return self->serve_create(caller_of_request(), make_id(id_w, id_l), make_id(fork_w, fork_l),
                              kind, name, make_id(target_w, target_l), tuple_elements(args));
  }));
  functions_.add(kFetch, make_handler(kFetch, [self](int64_t id_w, int64_t id_l) {
    self->check_worker(id_w, "RRef id");
    std::shared_ptr<OwnerEntry> entry = self->entry_or_placeholder(make_id(id_w, id_l));
    return entry->ready.then([entry](const Future<c10::IValue>& ready) {
      if (!entry->type.empty()) {
        throw RpcError(ErrorCode::kInvalidArgument,
                       "to_here() of an RRef to a '" + entry->type +
                           "' object: objects stay on their owner; call their methods instead");
      }
      return ready.value();
    });
  }));
  functions_.add(kCall, make_handler(kCall, [self](int64_t id_w, int64_t id_l, std::string method,
                                                    c10::IValue args) {
    self->check_worker(id_w, "RRef id");
    std::shared_ptr<OwnerEntry> entry = self->entry_or_placeholder(make_id(id_w, id_l));
    auto arg_values = std::make_shared<std::vector<c10::IValue>>(tuple_elements(args));
    // Runs once the object exists (creation is asynchronous).
    return entry->ready.then([entry, method, arg_values](const Future<c10::IValue>& ready) {
      return invoke_method(entry->type, entry->object.get(), ready, method, *arg_values);
    });
  }));
  functions_.add(kAddFork, make_handler(kAddFork, [self](int64_t id_w, int64_t id_l, int64_t fork_w,
                                                          int64_t fork_l, int64_t holder) {
    const int from = caller_of_request();
    self->check_worker(id_w, "RRef id");
    self->check_worker(holder, "fork holder");
    // A fork is named by the worker that makes it (RRefContext::encode).
    if (fork_w != from) {
      throw RpcError(ErrorCode::kPermissionDenied,
                     absl::StrCat("worker ", from, " cannot add a fork made by worker ", fork_w));
    }
    self->add_fork(make_id(id_w, id_l), make_id(fork_w, fork_l), static_cast<int>(holder));
  }));
  functions_.add(kDelFork, make_handler(kDelFork, [self](int64_t id_w, int64_t id_l, int64_t fork_w,
                                                          int64_t fork_l) {
    self->check_worker(id_w, "RRef id");
    self->check_worker(fork_w, "fork id");
    self->del_fork(make_id(id_w, id_l), make_id(fork_w, fork_l), caller_of_request());
  }));
}

// A placeholder's waiters hold it (their callbacks capture the entry):
// failing them also ends that cycle.
RRefContext::~RRefContext() { fail_awaited(); }

void RRefContext::fail_awaited() {
  std::vector<std::shared_ptr<OwnerEntry>> awaited;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = owned_.begin(); it != owned_.end();) {
      auto next = std::next(it);
      if (!it->second->initialized) {
        awaited.push_back(std::move(it->second));
        owned_.erase(it);
        --placeholders_;
      }
      it = next;
    }
  }
  for (auto& entry : awaited) {
    entry->ready.try_set_error(std::make_exception_ptr(
        RpcError(ErrorCode::kShutdown, "rref: RPC was shut down before the RRef was created")));
  }
}

void RRefContext::check_worker(int64_t id, const char* what) const {
  if (id < 0 || id >= world_size_) {
    throw RpcError(ErrorCode::kInvalidArgument,
                   absl::StrCat("rref: ", what, " names worker ", id, ", not one of the ",
                                world_size_, " workers"));
  }
}

RpcAgent* RRefContext::acquire_agent() {
  absl::MutexLock lock(&mu_);
  if (!agent_ || !agent_->running()) return nullptr;
  ++agent_users_;
  return agent_;
}

void RRefContext::release_agent() {
  absl::MutexLock lock(&mu_);
  --agent_users_;
}

void RRefContext::detach() {
  absl::MutexLock lock(&mu_);
  agent_ = nullptr;
  auto unused = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return agent_users_ == 0; };
  mu_.Await(absl::Condition(&unused));
}

RRefId RRefContext::next_id() { return RRefId{self_id_, next_local_++}; }

std::shared_ptr<RRefState> RRefContext::make_state(RRefId id, RRefId fork, int owner,
                                                   std::string type) {
  auto state = std::make_shared<RRefState>();
  state->id = id;
  state->fork = fork;
  state->owner = owner;
  state->type = std::move(type);
  state->context = weak_from_this();
  return state;
}

// ---------------------------------------------------------------- caller side

std::shared_ptr<RRefState> RRefContext::send_create(int to, const std::string& type,
                                                    const std::string& kind,
                                                    const std::string& name, RRefId target,
                                                    std::vector<c10::IValue> args,
                                                    absl::Duration timeout) {
  const RRefId id = next_id();
  // The creator's own handle is a fork like any other.
  auto state = make_state(id, id, to, type);
  RpcAgent* agent = acquire_agent();
  if (!agent) {
    state->created.set_error(RpcError(ErrorCode::kShutdown, "rpc::remote: RPC is not running"));
    return state;
  }
  Future<c10::IValue> reply = agent->call(
      to, kCreate,
      {c10::IValue(int64_t{id.worker}), c10::IValue(id.local), c10::IValue(int64_t{id.worker}),
       c10::IValue(id.local), c10::IValue(kind), c10::IValue(name),
       c10::IValue(int64_t{target.worker}), c10::IValue(target.local), as_tuple(std::move(args))},
      timeout, "remote", name);
  release_agent();
  Future<void> created = state->created;
  created.set_driver(reply.driver());  // waiting for it reads the reply
  reply.add_done_callback([created](const Future<c10::IValue>& f) {
    if (auto e = f.error()) {
      created.try_set_error(e);  // a call may have succeeded before the create timed out
    } else {
      created.try_set_result();  // a call's reply may have confirmed it first
    }
  });
  return state;
}

std::shared_ptr<RRefState> RRefContext::create_object(int to, const std::string& cls,
                                                      std::vector<c10::IValue> args,
                                                      absl::Duration timeout) {
  return send_create(to, cls, "object", cls, RRefId{}, std::move(args), timeout);
}

std::shared_ptr<RRefState> RRefContext::create_value(int to, const std::string& function,
                                                     std::vector<c10::IValue> args,
                                                     absl::Duration timeout) {
  return send_create(to, "", "function", function, RRefId{}, std::move(args), timeout);
}

std::shared_ptr<RRefState> RRefContext::create_method_value(const RRefState& target,
                                                            const std::string& method,
                                                            std::vector<c10::IValue> args,
                                                            absl::Duration timeout) {
  return send_create(target.owner, "", "method", method, target.id, std::move(args), timeout);
}

std::shared_ptr<RRefState> RRefContext::create_local(c10::IValue value) {
  return create_local_entry(std::move(value), nullptr, "");
}

std::shared_ptr<RRefState> RRefContext::create_local_object(std::shared_ptr<void> object,
                                                            std::string type) {
  if (!object) throw RpcError(ErrorCode::kInvalidArgument, "RRef of a null object");
  return create_local_entry(c10::IValue(), std::move(object), std::move(type));
}

std::shared_ptr<RRefState> RRefContext::create_local_entry(c10::IValue value,
                                                           std::shared_ptr<void> object,
                                                           std::string type) {
  const RRefId id = next_id();
  Future<c10::IValue> ready;
  {
    absl::MutexLock lock(&mu_);
    // A peer may have named this id before it existed (its messages made a
    // placeholder): the placeholder becomes the entry, and what waits on it
    // gets the value.
    auto& slot = owned_[id];
    if (slot && !slot->initialized) {
      --placeholders_;
    } else {
      slot = std::make_shared<OwnerEntry>();
    }
    slot->initialized = true;
    slot->type = type;
    slot->object = std::move(object);
    slot->local_handles = 1;
    ready = slot->ready;
  }
  ready.set_result(std::move(value));
  auto state = make_state(id, RRefId{}, self_id_, std::move(type));
  state->created.set_result();
  return state;
}

// A call served by the owner on this RRef proves that the owner created it,
// and its reply may overtake the create reply (the owner answers calls that
// waited for the object as soon as it exists). Unless creation is confirmed
// already, the returned future confirms it before it completes.
Future<c10::IValue> RRefContext::confirming(const RRefState& rref, Future<c10::IValue> call) {
  if (rref.created.completed()) return call;
  Future<void> created = rref.created;
  return call.then([created](const Future<c10::IValue>& f) {
    c10::IValue value = f.value();  // rethrows the call's error
    created.try_set_result();
    return value;
  });
}

bool RRefContext::creation_timed_out(const RRefState& rref, Future<c10::IValue>* failed) {
  std::exception_ptr error = rref.created.error();
  if (!error) return false;
  try {
    std::rethrow_exception(error);
  } catch (const RpcError& e) {
    if (e.code() != ErrorCode::kTimeout) return false;  // the owner reports other failures
  } catch (...) {
    return false;
  }
  failed->set_error(error);
  return true;
}

Future<c10::IValue> RRefContext::fetch(const RRefState& rref, absl::Duration timeout) {
  RpcAgent* agent = acquire_agent();
  if (!agent) {
    Future<c10::IValue> f;
    f.set_error(RpcError(ErrorCode::kShutdown, "RRef::to_here: RPC is not running"));
    return f;
  }
  if (Future<c10::IValue> failed; creation_timed_out(rref, &failed)) {
    release_agent();
    return failed;
  }
  Future<c10::IValue> f =
      agent->call(rref.owner, kFetch, {c10::IValue(int64_t{rref.id.worker}), c10::IValue(rref.id.local)},
                  timeout, "rref.to_here", "RRef");
  release_agent();
  return confirming(rref, std::move(f));
}

Future<c10::IValue> RRefContext::call_method(const RRefState& rref, const std::string& method,
                                             std::vector<c10::IValue> args,
                                             absl::Duration timeout) {
  RpcAgent* agent = acquire_agent();
  if (!agent) {
    Future<c10::IValue> f;
    f.set_error(RpcError(ErrorCode::kShutdown, "RRef method call: RPC is not running"));
    return f;
  }
  if (Future<c10::IValue> failed; creation_timed_out(rref, &failed)) {
    release_agent();
    return failed;
  }
  Future<c10::IValue> f = agent->call(
      rref.owner, kCall,
      {c10::IValue(int64_t{rref.id.worker}), c10::IValue(rref.id.local), c10::IValue(method),
       as_tuple(std::move(args))},
      timeout, "rref.rpc", rref.type + "." + method);
  release_agent();
  return confirming(rref, std::move(f));
}

// ----------------------------------------------------------------- owner side

std::shared_ptr<RRefContext::OwnerEntry> RRefContext::find(RRefId id) const {
  absl::MutexLock lock(&mu_);
  auto it = owned_.find(id);
  return it == owned_.end() ? nullptr : it->second;
}

std::shared_ptr<RRefContext::OwnerEntry> RRefContext::entry_or_placeholder_locked(RRefId id) {
  auto it = owned_.find(id);
  if (it != owned_.end()) return it->second;
  if (id.worker < 0 || id.worker >= world_size_) {
    throw RpcError(ErrorCode::kInvalidArgument,
                   absl::StrCat("rref: no RRef (", id.worker, ", ", id.local, ") exists here"));
  }
  if (placeholders_ >= kMaxPlaceholders) {
    throw RpcError(ErrorCode::kResourceExhausted,
                   absl::StrCat("rref: ", placeholders_,
                                " RRefs are awaiting their creation on this worker already"));
  }
  ++placeholders_;
  auto entry = std::make_shared<OwnerEntry>();
  owned_.emplace(id, entry);
  return entry;
}

std::shared_ptr<RRefContext::OwnerEntry> RRefContext::entry_or_placeholder(RRefId id) {
  std::shared_ptr<OwnerEntry> entry;
  bool placeholder;
  {
    absl::MutexLock lock(&mu_);
    const size_t before = placeholders_;
    entry = entry_or_placeholder_locked(id);
    placeholder = placeholders_ > before;
  }
  if (placeholder) schedule_expiry(id);
  return entry;
}

void RRefContext::after_rpc_timeout(std::function<void()> fn) {
  RpcAgent* agent = acquire_agent();
  if (!agent) return;
  absl::Duration wait = agent->rpc_timeout();
  if (wait <= absl::ZeroDuration() || wait == absl::InfiniteDuration()) wait = absl::Seconds(60);
  agent->run_at(absl::Now() + wait, std::move(fn));
  release_agent();
}

void RRefContext::schedule_expiry(RRefId id) {
  // A creation normally follows its overtaking messages within a message's
  // time; failing their waiters after the RPC timeout bounds how long a
  // bogus id pins them.
  std::weak_ptr<RRefContext> weak = weak_from_this();
  after_rpc_timeout([weak, id] {
    if (auto self = weak.lock()) self->expire_placeholder(id);
  });
}

void RRefContext::expire_placeholder(RRefId id) {
  std::shared_ptr<OwnerEntry> doomed;
  {
    absl::MutexLock lock(&mu_);
    auto it = owned_.find(id);
    if (it == owned_.end() || it->second->initialized) return;
    doomed = std::move(it->second);
    owned_.erase(it);
    --placeholders_;
  }
  doomed->ready.try_set_error(std::make_exception_ptr(RpcError(
      ErrorCode::kInvalidArgument,
      absl::StrCat("rref: RRef (", id.worker, ", ", id.local, ") was never created on worker ",
                   self_id_))));
}

Future<c10::IValue> RRefContext::serve_create(int from, RRefId id, RRefId fork,
                                              const std::string& kind, const std::string& name,
                                              RRefId target, std::vector<c10::IValue> args) {
  // The creator names the RRef and holds its first fork.
  if (id.worker != from || !(fork == id)) {
    throw RpcError(ErrorCode::kPermissionDenied,
                   absl::StrCat("rref: worker ", from, " cannot create RRef (", id.worker, ", ",
                                id.local, ") with fork (", fork.worker, ", ", fork.local, ")"));
  }
  if (kind != "object" && kind != "function" && kind != "method") {
    throw RpcError(ErrorCode::kMalformedMessage,
                   "rref: unknown creation kind '" + kind.substr(0, 64) + "'");
  }
  if (kind == "method") check_worker(target.worker, "method target");
  std::shared_ptr<OwnerEntry> entry;
  {
    absl::MutexLock lock(&mu_);
    if (kind == "method") {
      // Its value would wait for itself: along the RRefs made by methods of
      // others, the target must not lead back to it (nor too far to tell).
      RRefId at = target;
      for (int steps = 0;; ++steps) {
        if (at == id || steps >= kMaxMethodChain) {
          throw RpcError(ErrorCode::kInvalidArgument,
                         absl::StrCat("rref: RRef (", id.worker, ", ", id.local,
                                      ") cannot be made by a method of RRef (", target.worker,
                                      ", ", target.local, "), whose value ",
                                      at == id ? "would wait for its own" : "waits too far down"));
        }
        auto it = owned_.find(at);
        if (it == owned_.end() || !it->second->has_target || it->second->ready.completed()) break;
        at = it->second->target;
      }
    }
    auto& slot = owned_[id];
    if (!slot) {
      slot = std::make_shared<OwnerEntry>();
    } else if (!slot->initialized) {
      --placeholders_;
    }
    entry = slot;
    if (entry->initialized) return entry->ready;  // a repeated create
    entry->initialized = true;
    entry->type = kind == "object" ? name : "";
    entry->has_target = kind == "method";
    entry->target = target;
    auto early = entry->early_deletes.find(fork);
    if (early != entry->early_deletes.end() && early->second == from) {
      entry->early_deletes.erase(early);
    } else {
      entry->forks[fork] = from;
    }
  }
  Future<c10::IValue> ready = entry->ready;
  Future<c10::IValue> result;
  try {
    if (kind == "object") {
      const ClassInfo* info = ClassRegistry::global().find(name);
      if (!info || !info->constructor) {
        throw RpcError(ErrorCode::kUnknownFunction,
                       "no class '" + name + "' with a constructor is registered here");
      }
      entry->object = info->constructor(args);
      result = make_ready_future(c10::IValue());
    } else if (kind == "function") {
      const Handler* handler = user_functions_->find(name);
      if (!handler) {
        throw RpcError(ErrorCode::kUnknownFunction, "no function named '" + name + "' is registered");
      }
      result = (*handler)(args);
    } else {  // "method"
      std::shared_ptr<OwnerEntry> owner = entry_or_placeholder(target);
      auto arg_values = std::make_shared<std::vector<c10::IValue>>(std::move(args));
      result = owner->ready.then([owner, name, arg_values](const Future<c10::IValue>& f) {
        return invoke_method(owner->type, owner->object.get(), f, name, *arg_values);
      });
    }
  } catch (...) {
    ready.set_error(std::current_exception());
  }
  if (!ready.completed()) {
    result.add_done_callback([ready](const Future<c10::IValue>& f) { f.forward_to(ready); });
  }
  {
    // Every reference may already be gone (e.g. the creator dropped it).
    absl::MutexLock lock(&mu_);
    if (owned_.count(id)) entry = maybe_erase(id);
  }
  // The creator learns of success or failure; it only needs completion.
  return ready.then([](const Future<c10::IValue>& f) {
    f.wait();
    return c10::IValue();
  });
}

void RRefContext::add_fork(RRefId id, RRefId fork, int holder) {
  std::shared_ptr<OwnerEntry> doomed;
  bool placeholder = false;
  {
    absl::MutexLock lock(&mu_);
    const size_t before = placeholders_;
    std::shared_ptr<OwnerEntry> entry = entry_or_placeholder_locked(id);  // creation may be on its way
    placeholder = placeholders_ > before;
    auto early = entry->early_deletes.find(fork);
    if (early != entry->early_deletes.end() && early->second == holder) {
      entry->early_deletes.erase(early);  // its holder deleted it already
    } else {
      if (entry->forks.size() >= kMaxForksPerRRef && !entry->forks.count(fork)) {
        throw RpcError(ErrorCode::kResourceExhausted,
                       absl::StrCat("rref: RRef (", id.worker, ", ", id.local, ") has ",
                                    entry->forks.size(), " forks already"));
      }
      entry->forks[fork] = holder;
    }
    doomed = maybe_erase(id);
  }
  if (placeholder) schedule_expiry(id);
}

void RRefContext::del_fork(RRefId id, RRefId fork, int from) {
  std::shared_ptr<OwnerEntry> doomed;
  bool placeholder = false;
  bool early = false;
  {
    absl::MutexLock lock(&mu_);
    const size_t before = placeholders_;
    std::shared_ptr<OwnerEntry> entry = entry_or_placeholder_locked(id);  // creation may be on its way
    placeholder = placeholders_ > before;
    auto it = entry->forks.find(fork);
    if (it != entry->forks.end()) {
      if (it->second != from) {
        throw RpcError(ErrorCode::kPermissionDenied,
                       absl::StrCat("rref: worker ", from, " cannot delete fork (", fork.worker,
                                    ", ", fork.local, ") of RRef (", id.worker, ", ", id.local,
                                    "), held by worker ", it->second));
      }
      entry->forks.erase(it);
    } else {
      // Overtook the message adding it: it cancels that one, if that names
      // the same holder.
      if (entry->early_deletes.size() >= kMaxForksPerRRef) {
        throw RpcError(ErrorCode::kResourceExhausted,
                       absl::StrCat("rref: RRef (", id.worker, ", ", id.local, ") has ",
                                    entry->early_deletes.size(), " unmatched deletes already"));
      }
      entry->early_deletes[fork] = from;
      early = true;
    }
    doomed = maybe_erase(id);
  }
  if (placeholder) schedule_expiry(id);
  // The add it overtook comes within a message's time; one that never
  // comes (its sender died, or the delete was bogus) must not pin the
  // value for good.
  if (early) {
    std::weak_ptr<RRefContext> weak = weak_from_this();
    after_rpc_timeout([weak, id, fork] {
      if (auto self = weak.lock()) self->expire_early_delete(id, fork);
    });
  }
}

void RRefContext::expire_early_delete(RRefId id, RRefId fork) {
  std::shared_ptr<OwnerEntry> doomed;
  absl::MutexLock lock(&mu_);
  auto it = owned_.find(id);
  if (it == owned_.end() || it->second->early_deletes.erase(fork) == 0) return;
  doomed = maybe_erase(id);
}

size_t RRefContext::release_forks_held_by(int worker) {
  std::vector<std::shared_ptr<OwnerEntry>> doomed;  // destroyed after the lock
  size_t released = 0;
  absl::MutexLock lock(&mu_);
  std::vector<RRefId> touched;
  for (auto& [id, entry] : owned_) {
    const size_t before = entry->forks.size();
    for (auto it = entry->forks.begin(); it != entry->forks.end();) {
      if (it->second == worker) {
        entry->forks.erase(it++);
      } else {
        ++it;
      }
    }
    if (entry->forks.size() < before) {
      released += before - entry->forks.size();
      touched.push_back(id);
    }
  }
  for (const RRefId& id : touched) {
    if (std::shared_ptr<OwnerEntry> d = maybe_erase(id)) doomed.push_back(std::move(d));
  }
  return released;
}

void RRefContext::release_local(RRefId id) {
  std::shared_ptr<OwnerEntry> doomed;
  {
    absl::MutexLock lock(&mu_);
    auto it = owned_.find(id);
    if (it == owned_.end()) return;
    --it->second->local_handles;
    doomed = maybe_erase(id);
  }
}

std::shared_ptr<RRefContext::OwnerEntry> RRefContext::maybe_erase(RRefId id) {
  auto it = owned_.find(id);
  const OwnerEntry& e = *it->second;
  if (!e.initialized || !e.forks.empty() || e.local_handles > 0 || !e.early_deletes.empty()) {
    return nullptr;
  }
  std::shared_ptr<OwnerEntry> doomed = std::move(it->second);
  owned_.erase(it);
  return doomed;
}

std::shared_ptr<RRefContext::OwnerEntry> RRefContext::find_owned(const RRefState& rref) {
  std::shared_ptr<OwnerEntry> entry = find(rref.id);
  if (entry || rref.owner != self_id_) return entry;
  if (rref.id.worker == self_id_) {
    // rpc::remote to this worker: its create request may not have been
    // served yet. Its reply (or its failure) says when it has.
    rref.created.wait_for(absl::InfiniteDuration());  // bounded by the create call's timeout
    return find(rref.id);
  }
  // Created here by another worker, which may have sent it on (e.g. as an
  // argument) before its create request was served: a placeholder that the
  // creation fills, or that expires with an error.
  return entry_or_placeholder(rref.id);
}

Future<c10::IValue> RRefContext::local_value(const RRefState& rref) {
  std::shared_ptr<OwnerEntry> entry = find_owned(rref);
  if (!entry) {
    Future<c10::IValue> f;
    f.set_error(RpcError(ErrorCode::kInvalidArgument, "RRef is not owned by this worker"));
    return f;
  }
  // The entry's own kind decides, not what the handle claims (a peer
  // names the type of an RRef it sends).
  auto not_a_value = [self = self_id_, id = rref.id](const std::string& type) {
    return RpcError(ErrorCode::kInvalidArgument,
                    absl::StrCat("RRef (", id.worker, ", ", id.local, ") on worker ", self,
                                 " holds an object of class '", type.substr(0, 64),
                                 "', not a value"));
  };
  bool initialized;
  std::string type;
  {
    absl::MutexLock lock(&mu_);
    initialized = entry->initialized;
    type = entry->type;
  }
  if (initialized) {
    if (type.empty()) return entry->ready;
    Future<c10::IValue> f;
    f.set_error(not_a_value(type));
    return f;
  }
  // A placeholder: its creation decides.
  return entry->ready.then([entry, not_a_value](const Future<c10::IValue>& f) -> c10::IValue {
    if (!entry->type.empty()) throw not_a_value(entry->type);
    return f.value();
  });
}

std::shared_ptr<void> RRefContext::local_object(const RRefState& rref) {
  std::shared_ptr<OwnerEntry> entry = find_owned(rref);
  if (!entry) throw RpcError(ErrorCode::kInvalidArgument, "RRef is not owned by this worker");
  entry->ready.value();  // throws if the creation failed or never came
  // The handle's class (which the caller's type matched) must be the
  // entry's: a peer names the class of an RRef it sends.
  if (!entry->object || entry->type != rref.type) {
    throw RpcError(ErrorCode::kInvalidArgument,
                   absl::StrCat("RRef (", rref.id.worker, ", ", rref.id.local, ") on worker ",
                                self_id_, " holds ",
                                entry->object ? "an object of class '" + entry->type.substr(0, 64) + "'"
                                              : std::string("a value"),
                                ", not an object of class '", rref.type.substr(0, 64), "'"));
  }
  return entry->object;
}

void RRefContext::drained() {
  alive_at_shutdown_ = static_cast<int64_t>(owned_count());
  if (alive_at_shutdown_ > 0) {
    LOG(WARNING) << "rpc shutdown on worker " << self_id_ << ": " << alive_at_shutdown_
                 << " owned RRef(s) are still referenced";
  }
}

void RRefContext::add_debug_info(std::map<std::string, std::string>* info) const {
  (*info)["rref.owned"] = std::to_string(owned_count());
}

size_t RRefContext::owned_count() const {
  absl::MutexLock lock(&mu_);
  return owned_.size();
}

// ------------------------------------------------------------ wire and forks

void RRefContext::encode(const c10::IValue& capsule, int dest, wire::Extension* out) {
  auto* holder = dynamic_cast<RRefCapsule*>(capsule.toCapsule().get());
  if (!holder || !holder->state) throw TypeMismatch("this capsule cannot be sent over RPC");
  std::shared_ptr<RRefState> state = holder->state;
  const RRefId fork = next_id();
  if (state->owner == self_id_) {
    add_fork(state->id, fork, dest);
  } else {
    RpcAgent* agent = acquire_agent();
    if (!agent) throw RpcError(ErrorCode::kShutdown, "RRef: RPC is not running");
    // Keep this handle (and so its own fork) alive until the owner knows
    // the new fork.
    agent->call(state->owner, kAddFork,
                {c10::IValue(int64_t{state->id.worker}), c10::IValue(state->id.local),
                 c10::IValue(int64_t{fork.worker}), c10::IValue(fork.local),
                 c10::IValue(int64_t{dest})},
                kDefaultTimeout, "rref fork")
        .add_done_callback([state](const Future<c10::IValue>& f) {
          if (f.has_error()) LOG(WARNING) << "rref: fork registration failed: " << f.error_message();
        });
    release_agent();
  }
  out->set_type(kRRefExtension);
  out->set_data(absl::StrCat(state->id.worker, " ", state->id.local, " ", fork.worker, " ",
                             fork.local, " ", state->owner, " ", state->type));
}

c10::IValue RRefContext::decode(const wire::Extension& ext, int src) {
  if (ext.type() != kRRefExtension) {
    throw std::invalid_argument("unknown extension value '" + ext.type().substr(0, 64) + "'");
  }
  // "<id worker> <id local> <fork worker> <fork local> <owner> [<class>]":
  // five numbers and a class name (a C++ type's for "~" ones), checked for
  // size before it is split.
  constexpr size_t kMaxWireBytes = 4096;
  if (ext.data().size() > kMaxWireBytes) {
    throw std::invalid_argument(absl::StrCat("RRef of ", ext.data().size(),
                                             " bytes on the wire (at most ", kMaxWireBytes, ")"));
  }
  std::vector<absl::string_view> fields = absl::StrSplit(ext.data(), absl::MaxSplits(' ', 5));
  int64_t id_w, id_l, fork_w, fork_l, owner;
  if (fields.size() != 6 || !absl::SimpleAtoi(fields[0], &id_w) ||
      !absl::SimpleAtoi(fields[1], &id_l) || !absl::SimpleAtoi(fields[2], &fork_w) ||
      !absl::SimpleAtoi(fields[3], &fork_l) || !absl::SimpleAtoi(fields[4], &owner)) {
    throw std::invalid_argument("malformed RRef on the wire");
  }
  auto valid = [this](int64_t w) { return w >= 0 && w < world_size_; };
  // The sender made the fork it sends (encode()).
  if (!valid(id_w) || !valid(owner) || fork_w != src) {
    throw std::invalid_argument(absl::StrCat("RRef from worker ", src,
                                             " names workers that cannot have made it"));
  }
  const std::string type(fields[5]);
  // "~<C++ type>": an object of an unregistered class (a local owner RRef).
  if (!type.empty() && type[0] != '~' && ClassRegistry::global().find(type) == nullptr) {
    throw std::invalid_argument("RRef of unregistered class '" + type.substr(0, 64) + "'");
  }
  auto state = make_state(make_id(id_w, id_l), make_id(fork_w, fork_l), static_cast<int>(owner), type);
  state->created.set_result();
  return c10::IValue::make_capsule(c10::make_intrusive<RRefCapsule>(std::move(state)));
}

void RRefContext::release(const RRefState& state) {
  if (!state.fork.valid()) {
    release_local(state.id);
    return;
  }
  if (state.owner == self_id_) {
    try {
      del_fork(state.id, state.fork, self_id_);
    } catch (const std::exception& e) {
      LOG(WARNING) << "rref: releasing a fork failed: " << e.what();
    }
    return;
  }
  RpcAgent* agent = acquire_agent();
  if (!agent) return;  // shut down: the owner is gone or going
  agent->call(state.owner, kDelFork,
              {c10::IValue(int64_t{state.id.worker}), c10::IValue(state.id.local),
               c10::IValue(int64_t{state.fork.worker}), c10::IValue(state.fork.local)},
              kDefaultTimeout, "rref delete");
  release_agent();
}

}  // namespace ddprpc::rpc::internal
