// Bookkeeping of remote references on one worker, after PyTorch's RRef
// protocol, simplified:
//
// - The owner keeps an entry per RRef: the value (or object), a ready
//   future, the set of live forks (user handles elsewhere) and a count of
//   its own local handles. The entry, and so the value, goes away exactly
//   when no fork and no local handle is left.
// - Sending an RRef creates a new fork. If the sender is not the owner it
//   tells the owner (add_fork) and keeps its own handle until the owner has
//   acknowledged, so the count cannot reach zero in between. A delete that
//   overtakes its add is remembered and cancels the add.
// - Receiving an RRef creates a handle for that fork; dropping the last copy
//   of a handle deletes the fork at the owner.
//
// The owner trusts no message further than its sender's identity (the
// worker whose stream carried it): a creation must come from the worker
// that named the RRef, a fork is added by the worker that made it and
// deleted only by the worker holding it, an RRef on the wire must name
// valid workers and a registered class. Entries made for messages that
// overtook a creation (placeholders) are bounded in number and fail their
// waiters if the creation does not follow within the RPC timeout.
#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/extension.h"
#include "rpc/core/future.h"
#include "rpc/registry.h"
#include "rpc/rref/rref_state.h"
#include "rpc/wire/codec.h"

namespace ddprpc::rpc {

class RpcAgent;

namespace internal {

// The RRef extension of one agent (extension.h): it serves the owner's side
// of the protocol ("__rref.*") and encodes RRefs in messages.
class RRefContext : public AgentExtension, public std::enable_shared_from_this<RRefContext> {
 public:
  // The name agents know the extension by (RpcAgent::extension).
  static constexpr char kExtensionName[] = "rref";
  // Names of the internal functions start with this.
  static constexpr char kFunctionPrefix[] = "__rref.";
  // Bounds on what other workers' messages can make this worker hold.
  static constexpr size_t kMaxPlaceholders = 1 << 16;
  // RRefs made by methods of RRefs made by methods ..., still waiting, that
  // a new one may follow.
  static constexpr int kMaxMethodChain = 1024;
  static constexpr size_t kMaxForksPerRRef = 1 << 16;

  // `agent` may be null (nothing is sent; e.g. to serve requests in tests).
  RRefContext(RpcAgent* agent, int self_id, int world_size, const FunctionRegistry* user_functions);
  // Fails what waits for creations that never came (fail_awaited()).
  ~RRefContext() override;
  // Fails the waiters of every RRef whose creation has not come: the
  // agent is stopping, so it never will.
  void fail_awaited();

  // AgentExtension: the internal functions ("__rref.*") the agent serves.
  std::string function_prefix() const override { return kFunctionPrefix; }
  const FunctionRegistry& functions() const override { return functions_; }
  const ExtensionCodec* codec() const override { return &codec_; }
  void stopped() override { fail_awaited(); }
  // The agent is going away: later releases do nothing.
  void detach() override;
  // Counts what is still owned (alive_at_shutdown()).
  void drained() override;
  void add_debug_info(std::map<std::string, std::string>* info) const override;

  // RRefs this worker still owned when a graceful shutdown had heard from
  // every worker (0 unless some reference leaked); -1 before that.
  int64_t alive_at_shutdown() const { return alive_at_shutdown_.load(); }

  // Caller side. Creation is asynchronous: state->created reports the
  // outcome, an error with kTimeout when the owner has not confirmed it
  // within `timeout` (rpc::kDefaultTimeout: the agent's rpc_timeout).
  std::shared_ptr<RRefState> create_object(int to, const std::string& cls,
                                           std::vector<c10::IValue> args, absl::Duration timeout);
  std::shared_ptr<RRefState> create_value(int to, const std::string& function,
                                          std::vector<c10::IValue> args, absl::Duration timeout);
  std::shared_ptr<RRefState> create_method_value(const RRefState& target, const std::string& method,
                                                 std::vector<c10::IValue> args,
                                                 absl::Duration timeout);
  // An owner RRef of a local value, or of a local object whose type name
  // is `type` (internal::object_type_name).
  std::shared_ptr<RRefState> create_local(c10::IValue value);
  std::shared_ptr<RRefState> create_local_object(std::shared_ptr<void> object, std::string type);

  Future<c10::IValue> fetch(const RRefState& rref, absl::Duration timeout);
  Future<c10::IValue> call_method(const RRefState& rref, const std::string& method,
                                  std::vector<c10::IValue> args, absl::Duration timeout);

  // Owner side: the value / object once created (errors if creation failed,
  // or if this worker is not the owner).
  Future<c10::IValue> local_value(const RRefState& rref);
  std::shared_ptr<void> local_object(const RRefState& rref);

  // Live owner entries (values this worker owns that are still referenced).
  size_t owned_count() const;

  // RRefs in messages (codec()): a fork for `dest`, or the handle of one from `src`.
  void encode(const c10::IValue& capsule, int dest, wire::Extension* out);
  c10::IValue decode(const wire::Extension& ext, int src);

  void release(const RRefState& state);

  // Owner side: drops every fork `worker` holds of the RRefs this worker
  // owns, as if it had deleted them, and the entries nothing else holds.
  // Returns how many forks were dropped.
  size_t release_forks_held_by(int worker);

 private:
  struct OwnerEntry {
    std::string type;
    Future<c10::IValue> ready;     // the value; None for objects
    std::shared_ptr<void> object;  // set before `ready` completes
    absl::flat_hash_map<RRefId, int> forks;          // fork -> the worker holding it
    absl::flat_hash_map<RRefId, int> early_deletes;  // fork -> the worker that deleted it
    int local_handles = 0;
    // False for a placeholder made by a message that overtook the creation.
    bool initialized = false;
    // Made by a method of the RRef `target` (valid with `has_target`),
    // whose value it waits for.
    bool has_target = false;
    RRefId target;
  };

  RRefId next_id();
  std::shared_ptr<RRefState> create_local_entry(c10::IValue value, std::shared_ptr<void> object,
                                                std::string type);
  static Future<c10::IValue> confirming(const RRefState& rref, Future<c10::IValue> call);
  std::shared_ptr<RRefState> make_state(RRefId id, RRefId fork, int owner, std::string type);
  std::shared_ptr<OwnerEntry> find(RRefId id) const;
  // This worker's entry of `rref`, waiting for the creation of one it asked
  // this worker to create (rpc::remote to itself); for one another worker
  // created here, the entry or a placeholder its creation fills (it may be
  // served after a request that carries the RRef); nullptr if not owned here.
  std::shared_ptr<OwnerEntry> find_owned(const RRefState& rref);
  // The entry of an RRef owned here, or a placeholder that its creation
  // will fill. Throws RpcError for an id no worker could have made, or when
  // kMaxPlaceholders are waiting already.
  std::shared_ptr<OwnerEntry> entry_or_placeholder(RRefId id);
  std::shared_ptr<OwnerEntry> entry_or_placeholder_locked(RRefId id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void check_worker(int64_t id, const char* what) const;
  // `holder` holds the new fork.
  void add_fork(RRefId id, RRefId fork, int holder);
  // `from` deletes its fork.
  void del_fork(RRefId id, RRefId fork, int from);
  void release_local(RRefId id);
  // Erases the entry if nothing references it; returns it so that its value
  // is destroyed outside the lock.
  std::shared_ptr<OwnerEntry> maybe_erase(RRefId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails and drops the placeholder of `id` if its creation has not come.
  void expire_placeholder(RRefId id);
  void schedule_expiry(RRefId id);
  // Forgets the delete of `fork` that came before its add, if the add has
  // not come since (it then never will).
  void expire_early_delete(RRefId id, RRefId fork);
  // Runs `fn` on the agent's timer after its RPC timeout (60 s if none).
  void after_rpc_timeout(std::function<void()> fn);
  Future<c10::IValue> serve_create(int from, RRefId id, RRefId fork, const std::string& kind,
                                   const std::string& name, RRefId target,
                                   std::vector<c10::IValue> args);
  // True (with `failed` failed by it) when the RRef's creation timed out
  // before its owner confirmed it: its uses then fail with that error, as
  // PyTorch's do.
  bool creation_timed_out(const RRefState& rref, Future<c10::IValue>* failed);
  std::shared_ptr<RRefState> send_create(int to, const std::string& type, const std::string& kind,
                                         const std::string& name, RRefId target,
                                         std::vector<c10::IValue> args, absl::Duration timeout);

  // Pins the agent while it is used outside mu_; nullptr once detached.
  RpcAgent* acquire_agent();
  void release_agent();

  const int self_id_;
  const int world_size_;
  const FunctionRegistry* const user_functions_;
  FunctionRegistry functions_;
  ExtensionCodec codec_;
  std::atomic<int64_t> next_local_{1};
  std::atomic<int64_t> alive_at_shutdown_{-1};

  mutable absl::Mutex mu_;
  // State below is protected by mu_.
  RpcAgent* agent_ ABSL_GUARDED_BY(mu_);
  int agent_users_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<RRefId, std::shared_ptr<OwnerEntry>> owned_ ABSL_GUARDED_BY(mu_);
  size_t placeholders_ ABSL_GUARDED_BY(mu_) = 0;  // entries of owned_ not initialized
};

}  // namespace internal
}  // namespace ddprpc::rpc
