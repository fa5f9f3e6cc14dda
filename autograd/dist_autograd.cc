#include "autograd/dist_autograd.h"

#include <ATen/ops/ones_like.h>
#include <ATen/record_function.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <exception>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "autograd/internal/functions.h"
#include "autograd/internal/node_ptr.h"
#include "glog/logging.h"
#include "rpc/hooks.h"
#include "rpc/core/internal/fault.h"
#include "rpc/rpc.h"
#include "rpc/rref/rref.h"

namespace ddprpc::dist_autograd {
namespace {

using internal::make_node;
using internal::node_ptr;
using internal::NodePtr;
using internal::NodePtrOf;
using internal::RecvRpcBackward;
using internal::SendRpcBackward;
using torch::autograd::Edge;
using torch::autograd::Node;

constexpr char kContextKey[] = "dist_autograd.context";
constexpr char kMessageKey[] = "dist_autograd.message";
constexpr char kPropagate[] = "__dist_autograd.propagate";
constexpr char kReleasedKey[] = "dist_autograd.released";
constexpr char kFlushReleases[] = "__dist_autograd.flush_releases";
// How long a release may wait for another call to its worker before it
// goes out in a call of its own.
constexpr absl::Duration kReleaseDelay = absl::Milliseconds(20);

thread_local ContextId t_current = -1;

// A pass's context, for the threads libtorch's engine runs its nodes on
// besides the one that started it (a CUDA device's thread runs the nodes of
// tensors on that device, DDP's gradient hooks among them). The engine
// carries the starting thread's c10::ThreadLocalDebugInfo to them, so the
// pass sets its context there too (PassContext below).
struct PassContextInfo : c10::DebugInfoBase {
  explicit PassContextInfo(ContextId id) : id(id) {}
  const ContextId id;
  // False once the pass is over: a thread-local state saved during the
  // pass (by at::launch in a hook, say) does not carry the context beyond.
  std::atomic<bool> running{true};
};

// The debug-info slot of a pass's context: a slot of its own where
// libtorch's DebugInfoKind takes named slots; none before that (an enum of
// libtorch's own kinds), and then only the starting thread sees it.
template <typename Kind>
auto pass_kind_of(int) -> decltype(Kind(static_cast<const std::string_view*>(nullptr)),
                                   std::optional<Kind>()) {
  static constexpr std::string_view kName = "ddprpc.dist_autograd.pass_context";
  return Kind(&kName);
}
template <typename Kind>
std::optional<Kind> pass_kind_of(long) {
  return std::nullopt;
}
const std::optional<c10::DebugInfoKind>& pass_kind() {
  static const std::optional<c10::DebugInfoKind> kind = pass_kind_of<c10::DebugInfoKind>(0);
  return kind;
}

// The context this thread runs a pass's nodes for, or -1.
ContextId pass_context() {
  const auto& kind = pass_kind();
  if (!kind) return -1;
  const auto* info = static_cast<const PassContextInfo*>(c10::ThreadLocalDebugInfo::get(*kind));
  return info != nullptr && info->running.load(std::memory_order_acquire) ? info->id : -1;
}

// Bounds on what other workers' messages can make this worker hold.
constexpr size_t kMaxRemoteContexts = 1 << 16;    // contexts created by messages
constexpr size_t kMaxRemoteContextsPerSender = kMaxRemoteContexts / 4;  // by one worker's
constexpr size_t kMaxRecvsPerContext = 1 << 18;   // recv functions of one context
constexpr size_t kMaxSendsPerContext = 1 << 18;   // send functions of one context
std::atomic<int64_t> g_idle_timeout_ns{absl::ToInt64Nanoseconds(absl::Minutes(10))};
// Bytes of received tensors that contexts of other workers may hold here,
// all together (each keeps what its graph saved until it is released).
std::atomic<int64_t> g_max_remote_bytes{int64_t{4} << 30};
// ... and those that any one worker's messages brought.
std::atomic<int64_t> g_max_remote_bytes_per_sender{int64_t{1} << 30};

// The worker that created context `id` (see global_id).
int creator_of(ContextId id) { return static_cast<int>(id >> 48); }

// A send function and the worker its tensors went to (the only worker
// that may send their gradients back).
struct SendRecord {
  NodePtrOf<SendRpcBackward> fn;
  int dest;
};

// One context on this worker.
struct ContextState {
  // A context of this worker's own, or (remote) one that a message of
  // worker `introduced_by` brought here.
  ContextState(ContextId id, bool remote, int introduced_by = -1)
      : id(id), remote(remote), introduced_by(introduced_by) {
    touch();
  }
  const ContextId id;
  const bool remote;  // created by a message from another worker
  const int introduced_by;  // for a remote context, the worker whose message made it here
  // When a message of it last came or went (ns since the epoch).
  std::atomic<int64_t> last_used_ns{0};
  // Counted by the container, under its mutex (remote contexts): the bytes
  // of the tensors its received messages brought, by sending worker, and
  // how many messages found it here (find_or_create_remote).
  std::map<int, int64_t> received_bytes;
  int64_t joins = 0;
  void touch() { last_used_ns.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed); }
  absl::Mutex mu;
  // State below is protected by mu.
  std::map<int64_t, SendRecord> sends ABSL_GUARDED_BY(mu);
  std::vector<NodePtr> recvs ABSL_GUARDED_BY(mu);
  std::map<c10::TensorImpl*, std::pair<at::Tensor, at::Tensor>> grads ABSL_GUARDED_BY(mu);
  std::set<int> workers ABSL_GUARDED_BY(mu);
  // Nodes the backward passes of this context ran, and whether one asked to
  // retain the graph: passes keep the saved tensors (see run_pass), which
  // the release frees unless so asked.
  std::unordered_set<NodePtr> visited ABSL_GUARDED_BY(mu);
  bool retain_graph ABSL_GUARDED_BY(mu) = false;
};

class Container {
 public:
  // A context of this worker's own.
  std::shared_ptr<ContextState> create(ContextId id) {
    absl::MutexLock lock(&mu_);
    if (auto it = contexts_.find(id); it != contexts_.end()) return it->second;
    auto slot = std::make_shared<ContextState>(id, /*remote=*/false);
    contexts_.emplace(id, slot);
    return slot;
  }
  // The context a message names, created if new and another worker's:
  // bounded in number, dropped after going idle. nullptr for a context of
  // this worker's that it has left already (a late reply must not bring it
  // back). Throws RpcError for an id no worker could have made or when the
  // bound is hit.
  // A message of worker `src` makes at most kMaxRemoteContextsPerSender of
  // them live at once. `*created` tells whether this call made it.
  std::shared_ptr<ContextState> find_or_create_remote(ContextId id, int src, bool* created) {
    *created = false;
    {
      absl::MutexLock lock(&mu_);
      auto it = contexts_.find(id);
      if (it != contexts_.end()) {
        ++it->second->joins;
        return it->second;
      }
    }
    int world = -1, self = -1;
    try {
      auto agent = rpc::current_agent();
      world = static_cast<int>(agent->workers().size());
      self = agent->self().id;
    } catch (const rpc::RpcError&) {
    }
    if (id <= 0 || (world > 0 && creator_of(id) >= world)) {
      throw rpc::RpcError(rpc::ErrorCode::kInvalidArgument,
                          absl::StrCat("dist_autograd: context id ", id,
                                       " was not made by a worker of this job"));
    }
    if (creator_of(id) == self) return nullptr;
    absl::MutexLock lock(&mu_);
    // A request served after its context's release (it waited for a thread
    // while the release came in on another) must not bring it back.
    if (released_.count(id)) return nullptr;
    if (auto it = contexts_.find(id); it != contexts_.end()) {
      ++it->second->joins;
      return it->second;
    }
    if (remote_ >= kMaxRemoteContexts) {
      throw rpc::RpcError(rpc::ErrorCode::kResourceExhausted,
                          absl::StrCat("dist_autograd: ", remote_,
                                       " contexts of other workers are alive here already"));
    }
    size_t& brought = contexts_by_sender_[src];
    if (brought >= kMaxRemoteContextsPerSender) {
      throw rpc::RpcError(rpc::ErrorCode::kResourceExhausted,
                          absl::StrCat("dist_autograd: messages of worker ", src, " brought ",
                                       brought, " contexts here that are alive still"));
    }
    auto slot = std::make_shared<ContextState>(id, /*remote=*/true, /*introduced_by=*/src);
    slot->joins = 1;
    contexts_.emplace(id, slot);
    *created = true;
    ++remote_;
    ++brought;
    if (!janitor_started_) {
      janitor_started_ = true;
      std::thread([this] { janitor_loop(); }).detach();  // lives as long as the process
    }
    return slot;
  }
  // Drops remote context `ctx`, which the message that made it failed to
  // join, unless another message has found it since (that one may be
  // waiting for ctx->mu, or running in the context already): a refused
  // message leaves nothing. Called holding ctx->mu.
  void discard_unjoined(const std::shared_ptr<ContextState>& ctx) {
    absl::MutexLock lock(&mu_);
    auto it = contexts_.find(ctx->id);
    if (it == contexts_.end() || it->second != ctx || ctx->joins != 1) return;
    contexts_.erase(it);
    forget_remote_locked(*ctx);
  }
  std::shared_ptr<ContextState> find(ContextId id) {
    absl::MutexLock lock(&mu_);
    auto it = contexts_.find(id);
    return it == contexts_.end() ? nullptr : it->second;
  }
  std::shared_ptr<ContextState> get(ContextId id) {
    auto ctx = find(id);
    if (!ctx) {
      throw std::invalid_argument(absl::StrCat("dist_autograd: no context ", id,
                                               " on this worker (released already?)"));
    }
    return ctx;
  }
  std::shared_ptr<ContextState> erase(ContextId id) {
    absl::MutexLock lock(&mu_);
    auto it = contexts_.find(id);
    if (it == contexts_.end()) return nullptr;
    auto ctx = std::move(it->second);
    contexts_.erase(it);
    if (ctx->remote) {
      forget_remote_locked(*ctx);
      remember_released(id);
    }
    return ctx;
  }
  // Counts `bytes` of tensors that worker `src` sent into remote context
  // `ctx` against the bound on what that worker's messages brought and the
  // bound on all of them. Throws RpcError (kResourceExhausted) past either.
  // A context dropped meanwhile counts nothing (its tensors go with it).
  void add_received_bytes(ContextState& ctx, int src, int64_t bytes) {
    if (bytes == 0) return;
    absl::MutexLock lock(&mu_);
    auto it = contexts_.find(ctx.id);
    if (it == contexts_.end() || it->second.get() != &ctx) return;
    const auto mine = bytes_by_sender_.find(src);
    const int64_t held = mine == bytes_by_sender_.end() ? 0 : mine->second;
    const int64_t share = g_max_remote_bytes_per_sender.load();
    if (bytes > share - held) {
      throw rpc::RpcError(
          rpc::ErrorCode::kResourceExhausted,
          absl::StrCat("dist_autograd: messages of worker ", src, " brought ", held,
                       " bytes of tensors into contexts of other workers here already; ", bytes,
                       " more would pass ", share,
                       " (dist_autograd::set_max_remote_context_bytes_per_worker)"));
    }
    const int64_t most = g_max_remote_bytes.load();
    if (bytes > most - remote_bytes_) {
      throw rpc::RpcError(
          rpc::ErrorCode::kResourceExhausted,
          absl::StrCat("dist_autograd: contexts of other workers hold ", remote_bytes_,
                       " bytes of received tensors here already; ", bytes, " more would pass ",
                       most, " (dist_autograd::set_max_remote_context_bytes)"));
    }
    remote_bytes_ += bytes;
    bytes_by_sender_[src] += bytes;
    ctx.received_bytes[src] += bytes;
  }
  int64_t remote_bytes() {
    absl::MutexLock lock(&mu_);
    return remote_bytes_;
  }
  int64_t remote_bytes_from(int sender) {
    absl::MutexLock lock(&mu_);
    const auto it = bytes_by_sender_.find(sender);
    return it == bytes_by_sender_.end() ? 0 : it->second;
  }
  size_t size() {
    absl::MutexLock lock(&mu_);
    return contexts_.size();
  }
 private:
  // A remote context leaving: it no longer counts, and its received bytes
  // are free again.
  void forget_remote_locked(const ContextState& ctx) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    --remote_;
    auto by_src = contexts_by_sender_.find(ctx.introduced_by);
    if (by_src != contexts_by_sender_.end() && --by_src->second == 0) {
      contexts_by_sender_.erase(by_src);
    }
    for (const auto& [sender, bytes] : ctx.received_bytes) {
      remote_bytes_ -= bytes;
      auto it = bytes_by_sender_.find(sender);
      if ((it->second -= bytes) == 0) bytes_by_sender_.erase(it);
    }
  }
  // Released contexts of other workers, remembered for a while (bounded).
  static constexpr size_t kMaxReleased = 1 << 16;
  static constexpr absl::Duration kReleasedFor = absl::Minutes(2);
  void remember_released(ContextId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time now = absl::Now();
    while (!released_order_.empty() &&
           (released_order_.size() >= kMaxReleased || released_order_.front().first < now - kReleasedFor)) {
      released_.erase(released_order_.front().second);
      released_order_.pop_front();
    }
    if (released_.insert(id).second) released_order_.emplace_back(now, id);
  }

  // Drops contexts of other workers that nothing has used for the idle
  // timeout (their creator died, or lost its release).
  void janitor_loop() {
    while (true) {
      const absl::Duration timeout = absl::Nanoseconds(g_idle_timeout_ns.load());
      absl::SleepFor(std::clamp(timeout / 4, absl::Milliseconds(10), absl::Seconds(30)));
      try {
        const int64_t cutoff = absl::GetCurrentTimeNanos() - absl::ToInt64Nanoseconds(timeout);
        std::vector<std::shared_ptr<ContextState>> idle;
        {
          absl::MutexLock lock(&mu_);
          for (auto it = contexts_.begin(); it != contexts_.end();) {
            auto next = std::next(it);
            const auto& ctx = it->second;
            if (ctx->remote && ctx->last_used_ns.load(std::memory_order_relaxed) < cutoff) {
              // Remembered as a release is: a late message for it finds it
              // gone instead of making it again.
              remember_released(it->first);
              forget_remote_locked(*ctx);
              idle.push_back(std::move(it->second));
              contexts_.erase(it);
            }
            it = next;
          }
        }
        if (!idle.empty()) {
          LOG(WARNING) << "dist_autograd: dropped " << idle.size()
                       << " context(s) of other workers, idle for " << timeout;
        }
      } catch (const std::exception& e) {
        LOG(ERROR) << "dist_autograd: dropping idle contexts failed: " << e.what();
      }
    }
  }

  absl::Mutex mu_;
  absl::flat_hash_map<ContextId, std::shared_ptr<ContextState>> contexts_ ABSL_GUARDED_BY(mu_);
  size_t remote_ ABSL_GUARDED_BY(mu_) = 0;  // contexts_ created by messages
  int64_t remote_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // their received_bytes, all together
  absl::flat_hash_map<int, int64_t> bytes_by_sender_ ABSL_GUARDED_BY(mu_);  // and by sender
  absl::flat_hash_map<int, size_t> contexts_by_sender_ ABSL_GUARDED_BY(mu_);  // remote_, by sender
  absl::flat_hash_set<ContextId> released_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<absl::Time, ContextId>> released_order_ ABSL_GUARDED_BY(mu_);
  bool janitor_started_ ABSL_GUARDED_BY(mu_) = false;
};

Container& container() {
  static auto* c = new Container();
  return *c;
}

// The gradient hooks. Passes read an immutable published list: a pass never
// sees the list being changed, and adding a hook never waits for a pass.
// Each entry counts its calls under way, which its removal waits out (and
// only those).
class GradientHooks {
 public:
  int64_t add(GradientHook hook) {
    if (!hook) throw std::invalid_argument("dist_autograd: add_gradient_hook with a null hook");
    auto entry = std::make_shared<Entry>(std::move(hook));
    absl::MutexLock lock(&mu_);
    entry->id = next_id_++;
    auto list = std::make_shared<List>(*list_);
    list->push_back(entry);
    list_ = std::move(list);
    return entry->id;
  }

  void remove(int64_t id) {
    std::shared_ptr<Entry> entry;
    {
      absl::MutexLock lock(&mu_);
      auto list = std::make_shared<List>();
      for (const auto& e : *list_) {
        if (e->id == id) {
          entry = e;
        } else {
          list->push_back(e);
        }
      }
      if (!entry) return;
      list_ = std::move(list);
    }
    // Passes that took the list before it was published again may still
    // be about to call it: `removed` stops them. Calls on this thread (a
    // hook that removes itself) are not waited for.
    const std::thread::id me = std::this_thread::get_id();
    absl::MutexLock lock(&entry->mu);
    entry->removed = true;
    auto others_done = [&entry, me]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(entry->mu) {
      return std::all_of(entry->running.begin(), entry->running.end(),
                         [me](std::thread::id id) { return id == me; });
    };
    entry->mu.Await(absl::Condition(&others_done));
  }

  void run(ContextId context_id, std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads) {
    std::shared_ptr<const List> list;
    {
      absl::MutexLock lock(&mu_);
      list = list_;
    }
    for (const auto& entry : *list) {
      {
        absl::MutexLock lock(&entry->mu);
        if (entry->removed) continue;
        entry->running.push_back(std::this_thread::get_id());
      }
      Running running(entry.get());
      entry->hook(context_id, params, grads);
    }
  }

 private:
  struct Entry {
    explicit Entry(GradientHook hook) : hook(std::move(hook)) {}
    const GradientHook hook;
    int64_t id = 0;
    absl::Mutex mu;
    bool removed ABSL_GUARDED_BY(mu) = false;
    std::vector<std::thread::id> running ABSL_GUARDED_BY(mu);  // a thread per call under way
  };
  using List = std::vector<std::shared_ptr<Entry>>;

  // Ends one call of `entry` on this thread (counted in entry->running)
  // when destroyed, also when the hook throws.
  class Running {
   public:
    explicit Running(Entry* entry) : entry_(entry) {}
    ~Running() {
      absl::MutexLock lock(&entry_->mu);
      auto& running = entry_->running;
      running.erase(std::find(running.begin(), running.end(), std::this_thread::get_id()));
    }
    Running(const Running&) = delete;
    Running& operator=(const Running&) = delete;

   private:
    Entry* entry_;
  };

  absl::Mutex mu_;
  std::shared_ptr<const List> list_ ABSL_GUARDED_BY(mu_) = std::make_shared<const List>();
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

GradientHooks& gradient_hooks() {
  static auto* hooks = new GradientHooks();
  return *hooks;
}

std::atomic<int64_t> g_next_context{1};
std::atomic<int64_t> g_next_message{1};

int self_id() { return rpc::get_worker_info().id; }

int64_t global_id(std::atomic<int64_t>& counter) {
  return (static_cast<int64_t>(self_id()) << 48) | counter.fetch_add(1);
}

void collect_tensors(const c10::IValue& v, std::vector<at::Tensor>* out) {
  if (v.isTensor()) {
    out->push_back(v.toTensor());
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) collect_tensors(e, out);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) collect_tensors(e, out);
  }
}

std::vector<at::Tensor> requiring_grad(const c10::IValue& v) {
  std::vector<at::Tensor> all, out;
  collect_tensors(v, &all);
  for (auto& t : all) {
    if (t.defined() && t.requires_grad()) out.push_back(t);
  }
  return out;
}

// Sender: record a send function for the tensors that require grad.
void attach_send(const std::shared_ptr<ContextState>& ctx, int dest, const c10::IValue& value,
                 rpc::MessageExt* ext) {
  (*ext)[kContextKey] = absl::StrCat(ctx->id);
  ctx->touch();
  std::vector<at::Tensor> tensors = requiring_grad(value);
  absl::MutexLock lock(&ctx->mu);
  ctx->workers.insert(dest);
  if (tensors.empty()) return;
  if (ctx->sends.size() >= kMaxSendsPerContext) {
    throw rpc::RpcError(rpc::ErrorCode::kResourceExhausted,
                        absl::StrCat("dist_autograd: context ", ctx->id, " has ", ctx->sends.size(),
                                     " sent messages already"));
  }
  auto send = make_node<SendRpcBackward>();
  send->set_next_edges(torch::autograd::collect_next_edges(tensors));
  for (const auto& t : tensors) send->add_input_metadata(t);
  const int64_t message = global_id(g_next_message);
  ctx->sends[message] = SendRecord{std::move(send), dest};
  (*ext)[kMessageKey] = absl::StrCat(message);
}

// Receiver: the received tensors get a recv function as grad_fn.
std::shared_ptr<ContextState> attach_recv(int src, const c10::IValue& value,
                                          const rpc::MessageExt& ext, bool request) {
  auto it = ext.find(kContextKey);
  if (it == ext.end()) return nullptr;
  ContextId id;
  if (!absl::SimpleAtoi(it->second, &id)) {
    throw std::invalid_argument("dist_autograd: malformed context id");
  }
  bool created = false;
  std::shared_ptr<ContextState> ctx = container().find_or_create_remote(id, src, &created);
  if (!ctx) return nullptr;
  ctx->touch();
  absl::MutexLock lock(&ctx->mu);
  // A message refused below leaves no context of its making behind, unless
  // another message joined it meanwhile.
  const int unwinding = std::uncaught_exceptions();
  auto discard = absl::MakeCleanup([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {  // ctx->mu is held
    if (created && std::uncaught_exceptions() > unwinding && ctx->recvs.empty() &&
        ctx->sends.empty() && ctx->grads.empty()) {
      container().discard_unjoined(ctx);
    }
  });
  // A request's reply may record a send function: a context at that bound
  // takes no more requests (refused before they run).
  if (request && ctx->sends.size() >= kMaxSendsPerContext) {
    throw rpc::RpcError(rpc::ErrorCode::kResourceExhausted,
                        absl::StrCat("dist_autograd: context ", id, " has ", ctx->sends.size(),
                                     " sent messages already"));
  }
  ctx->workers.insert(src);
  auto msg = ext.find(kMessageKey);
  if (msg == ext.end()) return ctx;
  int64_t message;
  if (!absl::SimpleAtoi(msg->second, &message)) {
    throw std::invalid_argument("dist_autograd: malformed message id");
  }
  std::vector<at::Tensor> tensors = requiring_grad(value);
  if (tensors.empty()) return ctx;
  if (ctx->recvs.size() >= kMaxRecvsPerContext) {
    throw rpc::RpcError(rpc::ErrorCode::kResourceExhausted,
                        absl::StrCat("dist_autograd: context ", id, " has ", ctx->recvs.size(),
                                     " received messages already"));
  }
  auto recv = make_node<RecvRpcBackward>(src, message);
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor& t = tensors[i];
    t.requires_grad_(false);  // a fresh leaf; its history is the recv function
    recv->add_input_metadata(t);
    torch::autograd::impl::set_gradient_edge(t, Edge(recv, static_cast<uint32_t>(i)));
  }
  ctx->recvs.push_back(std::move(recv));
  if (ctx->remote) {
    // Counted last, so that a message failing before counts nothing; one
    // past the bound takes its recv function back out and fails.
    int64_t bytes = 0;
    for (const at::Tensor& t : tensors) {
      // A sparse tensor's bytes are its indices' and values'.
      bytes += t.is_sparse() ? static_cast<int64_t>(t._indices().nbytes() + t._values().nbytes())
                             : static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
    }
    try {
      container().add_received_bytes(*ctx, src, bytes);
    } catch (...) {
      ctx->recvs.pop_back();
      throw;
    }
  }
  return ctx;
}

// Releases of finished contexts on other workers. Instead of a notice per
// worker per context, they wait for the next call this process makes to
// that worker (typically the next iteration's first call) and ride in its
// ext; a flusher thread makes one call per worker for what waited longer
// than kReleaseDelay. Releases whose call fails are queued again (a release
// that did arrive is harmless to repeat) and dropped after kReleaseAttempts
// failed calls, when the worker is most likely gone.
class PendingReleases {
 public:
  // A release and the number of failed calls it rode in.
  struct Release {
    ContextId id;
    int attempts;
  };
  // Releases carried by one call, handed back if it fails.
  struct Carried {
    int worker;
    std::vector<Release> releases;
  };

  void add(int worker, ContextId id) { add(worker, {Release{id, 0}}); }

  void requeue(const Carried& c) {
    std::vector<Release> again;
    for (const Release& r : c.releases) {
      if (r.attempts + 1 < kReleaseAttempts) again.push_back({r.id, r.attempts + 1});
    }
    if (again.size() < c.releases.size()) {
      VLOG(1) << "dist_autograd: " << c.releases.size() - again.size()
              << " context release(s) for worker " << c.worker << " dropped after "
              << kReleaseAttempts << " failed calls";
    }
    if (!again.empty()) add(c.worker, again);
  }

  // Moves the releases waiting for `worker` into `ext` and returns them.
  // Without any waiting (every message of a process that never used a
  // context) it costs one atomic load.
  std::optional<Carried> attach(int worker, rpc::MessageExt* ext) {
    if (count_.load(std::memory_order_relaxed) == 0) return std::nullopt;
    std::optional<Carried> taken = take(worker);
    if (!taken) return std::nullopt;
    std::string& out = (*ext)[kReleasedKey];
    for (const Release& r : taken->releases) {
      if (!out.empty()) out += ',';
      absl::StrAppend(&out, r.id);
    }
    return taken;
  }

 private:
  static constexpr int kReleaseAttempts = 3;

  struct Waiting {
    absl::Time since;  // when the oldest of `releases` was added
    std::vector<Release> releases;
  };

  void add(int worker, const std::vector<Release>& releases) {
    absl::MutexLock lock(&mu_);
    Waiting& w = waiting_[worker];
    if (w.releases.empty()) w.since = absl::Now();
    w.releases.insert(w.releases.end(), releases.begin(), releases.end());
    count_.fetch_add(static_cast<int64_t>(releases.size()), std::memory_order_relaxed);
    if (!flusher_started_) {
      flusher_started_ = true;
      std::thread([this] { flush_loop_guarded(); }).detach();  // lives as long as the process
    }
  }

  std::optional<Carried> take(int worker) {
    absl::MutexLock lock(&mu_);
    auto it = waiting_.find(worker);
    if (it == waiting_.end() || it->second.releases.empty()) return std::nullopt;
    Carried c{worker, {}};
    c.releases.swap(it->second.releases);
    count_.fetch_sub(static_cast<int64_t>(c.releases.size()), std::memory_order_relaxed);
    return c;
  }

  void flush_loop() {
    while (true) {
      absl::Time due_at;
      {
        absl::MutexLock lock(&mu_);
        auto waiting = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return count_.load(std::memory_order_relaxed) > 0;
        };
        mu_.Await(absl::Condition(&waiting));
        absl::Time oldest = absl::InfiniteFuture();
        for (const auto& [worker, w] : waiting_) {
          if (!w.releases.empty()) oldest = std::min(oldest, w.since);
        }
        due_at = oldest + kReleaseDelay;
      }
      absl::SleepFor(due_at - absl::Now());  // meanwhile a call may carry them off
      std::vector<int> due;
      {
        absl::MutexLock lock(&mu_);
        const absl::Time now = absl::Now();
        for (const auto& [worker, w] : waiting_) {
          if (!w.releases.empty() && now - w.since >= kReleaseDelay) due.push_back(worker);
        }
      }
      for (int worker : due) {
        rpc::internal::fault_point("dist_autograd.flush");
        flush(worker);
      }
    }
  }

  // flush_loop() without an exception leaving the thread; what waited is
  // flushed on the next round.
  void flush_loop_guarded() {
    while (true) {
      try {
        flush_loop();
      } catch (const std::exception& e) {
        LOG(ERROR) << "dist_autograd: sending context releases failed: " << e.what();
      }
    }
  }

  // The call's ext picks up the releases (DistAutogradHook::start_call),
  // which come back here if it fails. Without RPC (shut down) there is
  // nobody left to tell: they are dropped.
  void flush(int worker) {
    try {
      rpc::current_agent()->call(worker, kFlushReleases, {}, kFlushTimeout, "rpc_async", "");
    } catch (const std::exception& e) {
      VLOG(1) << "dist_autograd: releases for worker " << worker << " dropped: " << e.what();
      take(worker);
    }
  }

  static constexpr absl::Duration kFlushTimeout = absl::Seconds(30);

  std::atomic<int64_t> count_{0};  // releases waiting, all workers
  absl::Mutex mu_;
  // State below is protected by mu_.
  std::map<int, Waiting> waiting_ ABSL_GUARDED_BY(mu_);
  bool flusher_started_ ABSL_GUARDED_BY(mu_) = false;
};

void release_attached(int src, const rpc::MessageExt& ext);

PendingReleases& pending_releases() {
  static auto* p = new PendingReleases();
  return *p;
}

class DistAutogradHook : public rpc::RpcHook {
 public:
  // Releases ride in calls (not one-way notices), whose failure comes back
  // to end_call.
  std::shared_ptr<void> start_call(const rpc::OutgoingCall& call, rpc::MessageExt* ext) override {
    std::optional<PendingReleases::Carried> carried = pending_releases().attach(call.to.id, ext);
    if (!carried) return nullptr;
    return std::make_shared<PendingReleases::Carried>(std::move(*carried));
  }
  void end_call(const std::shared_ptr<void>& state, const rpc::MessageExt* reply) override {
    if (reply == nullptr) {
      pending_releases().requeue(*static_cast<const PendingReleases::Carried*>(state.get()));
    }
  }
  void outgoing_request(int dest, const c10::IValue& args, rpc::MessageExt* ext) override {
    const ContextId current = current_context_id();
    if (current < 0) return;
    if (auto ctx = container().find(current)) attach_send(ctx, dest, args, ext);
  }
  std::shared_ptr<void> incoming_request(int src, const c10::IValue& args,
                                         const rpc::MessageExt& ext) override {
    release_attached(src, ext);
    return attach_recv(src, args, ext, /*request=*/true);
  }
  std::shared_ptr<void> enter(const std::shared_ptr<void>& state) override {
    if (!state) return nullptr;
    struct Guard {
      ContextId saved;
      ~Guard() { t_current = saved; }
    };
    auto guard = std::make_shared<Guard>(Guard{t_current});
    t_current = static_cast<ContextState*>(state.get())->id;
    return guard;
  }
  void outgoing_response(int dest, const std::shared_ptr<void>& state, const c10::IValue& result,
                         rpc::MessageExt* ext) override {
    if (state) attach_send(std::static_pointer_cast<ContextState>(state), dest, result, ext);
  }
  void incoming_response(int src, const c10::IValue& result, const rpc::MessageExt& ext) override {
    attach_recv(src, result, ext, /*request=*/false);
  }
};

// Makes `id` the current context of this thread within its scope, and of
// the threads the engine runs the pass's nodes on (what the hooks of the
// nodes a pass runs see, e.g. DDP's).
class PassContext {
 public:
  explicit PassContext(ContextId id) : saved_(t_current) {
    t_current = id;
    if (const auto& kind = pass_kind()) {
      info_ = std::make_shared<PassContextInfo>(id);
      guard_.emplace(*kind, info_);
    }
  }
  ~PassContext() {
    if (info_) info_->running.store(false, std::memory_order_release);
    t_current = saved_;
  }

 private:
  const ContextId saved_;
  std::shared_ptr<PassContextInfo> info_;
  std::optional<c10::DebugInfoGuard> guard_;
};

// The gradients `grads` after the pre-hooks of `node`, which the engine runs
// for the nodes it runs but not for those whose inputs a pass captures
// (leaves' AccumulateGrad, received tensors' RecvRpcBackward), so that their
// hooks run as in local autograd.
torch::autograd::variable_list after_pre_hooks(Node* node, torch::autograd::variable_list grads) {
  for (const auto& hook : node->pre_hooks()) grads = (*hook)(grads);
  return grads;
}

// Runs the local engine from `roots` and, for every recv function reached,
// sends its gradients back to the sender. Returns those sends' futures.
//
// A node may be reached by several passes of one context: gradients come
// back through several send functions (a tensor both used here and sent on
// in a nested call; one received tensor passed to two calls). Each pass runs
// it on its share of the gradient; a backward function is linear in the
// gradient it gets, so the shares add up to what local autograd computes.
// Passes therefore keep the saved tensors (keep_graph), and the context's
// release frees them, unless a backward asked to retain the graph.
std::vector<rpc::Future<c10::IValue>> run_pass(const std::shared_ptr<ContextState>& ctx,
                                               const torch::autograd::edge_list& roots,
                                               const std::vector<at::Tensor>& grads,
                                               bool retain_graph) {
  torch::autograd::edge_list outputs, recv_outputs;  // leaves first, then recv inputs
  std::vector<torch::autograd::AccumulateGrad*> leaves;
  std::vector<RecvRpcBackward*> recvs;
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  for (const auto& e : roots) {
    if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      outputs.emplace_back(node_ptr(acc), 0);
      leaves.push_back(acc);
      continue;
    }
    if (auto* recv = dynamic_cast<RecvRpcBackward*>(node)) {
      recvs.push_back(recv);
      for (uint32_t i = 0; i < recv->num_inputs(); ++i) {
        recv_outputs.emplace_back(node_ptr(recv), i);
      }
      continue;
    }
    for (const auto& next : node->next_edges()) {
      if (next.function && seen.insert(next.function.get()).second) {
        stack.push_back(next.function.get());
      }
    }
  }
  outputs.insert(outputs.end(), recv_outputs.begin(), recv_outputs.end());
  if (outputs.empty()) return {};
  {
    absl::MutexLock lock(&ctx->mu);
    if (retain_graph) ctx->retain_graph = true;
    for (Node* node : seen) ctx->visited.insert(node_ptr(node));
  }
  PassContext in_context(ctx->id);
  torch::autograd::variable_list results = torch::autograd::Engine::get_default_engine().execute(
      roots, grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false, outputs);

  // First send the gradients of the received tensors back to their senders,
  // so the other workers' passes overlap with the rest of this one.
  std::vector<rpc::Future<c10::IValue>> sends;
  size_t next = leaves.size();
  for (RecvRpcBackward* recv : recvs) {
    // The recv function's share of the pass, as profilers see it.
    RECORD_USER_SCOPE("RecvRpcBackward");
    std::vector<at::Tensor> recv_grads = after_pre_hooks(
        recv, torch::autograd::variable_list(results.begin() + next,
                                             results.begin() + next + recv->num_inputs()));
    next += recv->num_inputs();
    sends.push_back(rpc::current_agent()->call(
        recv->src, kPropagate,
        {c10::IValue(ctx->id), c10::IValue(recv->message_id),
         c10::IValue(c10::List<at::Tensor>(recv_grads)), c10::IValue(retain_graph)},
        rpc::kDefaultTimeout, "dist_autograd.backward"));
  }
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> param_grads;
  params.reserve(leaves.size());
  param_grads.reserve(leaves.size());
  for (size_t i = 0; i < leaves.size(); ++i) {
    params.push_back(leaves[i]->variable);
    // Moved out of `results`, so that a gradient no other tensor refers to
    // has a use count of 1 (below). libtorch's engine ran the leaf's tensor
    // hooks (AccumulateGrad's tensor pre-hooks) before it captured the
    // gradient; the node's own pre-hooks run here, as AccumulateGrad::apply
    // would have seen them.
    at::Tensor grad = std::move(results[i]);
    if (!leaves[i]->pre_hooks().empty()) grad = after_pre_hooks(leaves[i], {std::move(grad)})[0];
    param_grads.push_back(std::move(grad));
  }
  results.clear();
  gradient_hooks().run(ctx->id, params, param_grads);
  {
    absl::MutexLock lock(&ctx->mu);
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& grad = param_grads[i];
      if (!grad.defined()) continue;
      auto& slot = ctx->grads[params[i].unsafeGetTensorImpl()];
      if (slot.first.defined()) {
        if (slot.second.is_sparse() && !grad.is_sparse()) {
          slot.second = grad + slot.second;  // a dense sum
        } else {
          slot.second.add_(grad);  // dense or sparse (COO): sparse + sparse stays sparse
        }
      } else if (grad.is_sparse()) {
        // A sparse gradient (e.g. EmbeddingBag's with sparse=true) stays
        // sparse: an optimizer then touches only the rows it names.
        slot = {params[i], grad.use_count() == 1 ? std::move(grad) : grad.clone()};
      } else if (grad.use_count() == 1 && grad.is_non_overlapping_and_dense() &&
                 grad.strides() == params[i].strides()) {
        // As PyTorch's AccumulateGrad: a gradient nothing else refers to,
        // laid out as its parameter, is kept as it is (the engine's fresh
        // output, or DDP's average), not copied.
        slot = {params[i], std::move(grad)};
      } else {
        // E.g. one tensor reaching two leaves, or an expanded one.
        slot = {params[i], grad.clone(at::MemoryFormat::Contiguous)};
      }
    }
  }
  // Post-accumulate hooks (of AccumulateGrad) see the gradient this pass added.
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (leaves[i]->post_hooks().empty()) continue;
    const torch::autograd::variable_list inputs = {param_grads[i]};
    for (const auto& hook : leaves[i]->post_hooks()) (*hook)({}, inputs);
  }
  return sends;
}

rpc::Future<c10::IValue> all_done(std::vector<rpc::Future<c10::IValue>> futures) {
  return rpc::collect_all(std::move(futures))
      .then([](const rpc::Future<std::vector<rpc::Future<c10::IValue>>>& all) {
        for (const auto& f : all.value()) f.wait();  // rethrows the first error
        return c10::IValue();
      });
}

// Worker-side continuation of backward from the send function `message`,
// whose tensors went to the calling worker.
rpc::Future<c10::IValue> propagate(int64_t context_id, int64_t message, std::vector<at::Tensor> grads,
                                   bool retain_graph) {
  const rpc::CallContext* call = rpc::current_call();
  const int from = call ? call->caller : -1;
  std::shared_ptr<ContextState> ctx = container().get(context_id);
  ctx->touch();
  NodePtrOf<SendRpcBackward> send;
  {
    absl::MutexLock lock(&ctx->mu);
    auto it = ctx->sends.find(message);
    if (it == ctx->sends.end()) {
      throw std::invalid_argument(absl::StrCat("dist_autograd: context ", context_id,
                                               " has no send function ", message));
    }
    if (it->second.dest != from) {
      throw rpc::RpcError(rpc::ErrorCode::kPermissionDenied,
                          absl::StrCat("dist_autograd: worker ", from,
                                       " sends gradients for tensors it did not receive"));
    }
    send = it->second.fn;
  }
  if (grads.size() != send->num_inputs()) {
    throw std::invalid_argument("dist_autograd: gradient count does not match the send function");
  }
  torch::autograd::edge_list roots;
  for (uint32_t i = 0; i < send->num_inputs(); ++i) {
    roots.emplace_back(send, i);
    const torch::autograd::InputMetadata& meta = send->input_metadata(i);
    if (!grads[i].defined()) {
      grads[i] = meta.zeros_like();
    } else if (grads[i].dtype() != meta.dtype() || !meta.is_same_shape(grads[i])) {
      throw std::invalid_argument(absl::StrCat("dist_autograd: gradient ", i, " of shape ",
                                               c10::str(grads[i].sizes()), " and dtype ",
                                               c10::toString(grads[i].scalar_type()),
                                               " does not match the tensor it is for"));
    } else if (grads[i].device() != meta.device()) {
      // The wire carries no device: a gradient arrives in host memory, and
      // the engine wants it where the sent tensor was.
      grads[i] = grads[i].to(meta.device());
    }
  }
  // The send function's part of the pass (from its gradients on), as
  // profilers see it.
  RECORD_USER_SCOPE("SendRpcBackward");
  return all_done(run_pass(ctx, roots, grads, retain_graph));
}
DDPRPC_REGISTER_FUNCTION_AS(dist_autograd_propagate, kPropagate, propagate);

// Releases a context here and on the workers this one talked to within it.
void release_context(ContextId id, int from) {
  std::shared_ptr<ContextState> ctx = container().erase(id);
  if (!ctx) return;
  std::set<int> workers;
  std::unordered_set<NodePtr> visited;
  {
    absl::MutexLock lock(&ctx->mu);
    workers = ctx->workers;
    if (!ctx->retain_graph) visited.swap(ctx->visited);
  }
  // The saved tensors the passes kept (run_pass).
  for (const auto& node : visited) node->release_variables();
  int self;
  try {
    self = self_id();
  } catch (const rpc::RpcError&) {
    return;  // shut down: nothing to tell
  }
  for (int w : workers) {
    if (w != from && w != self) pending_releases().add(w, id);
  }
}

// Releases named in a message's ext (see PendingReleases), each honoured
// only if `src` is the context's creator, or the worker whose message
// brought the context here (which forwards the creator's release). A
// context this worker created is released by its own Context only: a
// participant cannot end it, nor make another worker end it by joining
// the context first with a message of its own.
void release_attached(int src, const rpc::MessageExt& ext) {
  if (ext.empty()) return;
  auto it = ext.find(kReleasedKey);
  if (it == ext.end()) return;
  for (absl::string_view s : absl::StrSplit(it->second, ',', absl::SkipEmpty())) {
    ContextId id;
    if (!absl::SimpleAtoi(s, &id)) {
      throw std::invalid_argument("dist_autograd: malformed context release");
    }
    std::shared_ptr<ContextState> ctx = container().find(id);
    if (!ctx) continue;  // released already
    const bool may = ctx->remote && (creator_of(id) == src || ctx->introduced_by == src);
    if (!may) {
      LOG(WARNING) << "dist_autograd: ignoring the release of context " << id << " by worker "
                   << src << ", which neither created it nor brought it here";
      continue;
    }
    release_context(id, src);
  }
}

// A call that carries only releases in its ext (the hook handles them).
int64_t flush_releases() { return 0; }
DDPRPC_REGISTER_FUNCTION_AS(dist_autograd_flush_releases, kFlushReleases, flush_releases);

const bool kHookInstalled = [] {
  rpc::add_rpc_hook(std::make_shared<DistAutogradHook>());
  return true;
}();

}  // namespace

Context::Context() : id_(global_id(g_next_context)), previous_(t_current) {
  (void)kHookInstalled;
  container().create(id_);
  t_current = id_;
}

Context::~Context() {
  t_current = previous_;
  release_context(id_, -1);
}

ContextId current_context_id() { return t_current >= 0 ? t_current : pass_context(); }

void backward(ContextId context_id, const std::vector<at::Tensor>& roots, bool retain_graph) {
  std::shared_ptr<ContextState> ctx = container().get(context_id);
  torch::autograd::edge_list edges;
  std::vector<at::Tensor> grads;
  for (const at::Tensor& root : roots) {
    if (!root.requires_grad()) {
      throw std::invalid_argument("dist_autograd::backward: a root does not require grad");
    }
    if (root.numel() != 1) {
      throw std::invalid_argument("dist_autograd::backward: roots must be scalars");
    }
    edges.push_back(torch::autograd::impl::gradient_edge(root));
    grads.push_back(at::ones_like(root));
  }
  // This thread waits for the pass's sends: it reads their replies itself.
  rpc::SyncCallScope waited_here;
  all_done(run_pass(ctx, edges, grads, retain_graph)).value();
}

namespace {
// The owner's side of backward(context_id, RRef).
void backward_from_rref(int64_t context_id, rpc::RRef<at::Tensor> root, bool retain_graph) {
  backward(context_id, {root.local_value()}, retain_graph);
}
}  // namespace
DDPRPC_REGISTER_FUNCTION_AS(dist_autograd_rref_backward, "__dist_autograd.rref_backward",
                            backward_from_rref);

void backward(ContextId context_id, const rpc::RRef<at::Tensor>& root, bool retain_graph) {
  if (root.is_owner()) return backward(context_id, {root.local_value()}, retain_graph);
  // The owner serves the call only once it holds the value: wait for it to
  // confirm the creation (this also throws a creation's error).
  root.state().created.wait();
  // Inside the context, so that the owner finds it (and learns of its release).
  const ContextId previous = t_current;
  t_current = context_id;
  struct Restore {
    ContextId previous;
    ~Restore() { t_current = previous; }
  } restore{previous};
  rpc::rpc_sync<void>(root.owner().id, "__dist_autograd.rref_backward", context_id, root,
                      retain_graph);
}

c10::Dict<at::Tensor, at::Tensor> get_gradients(ContextId context_id) {
  std::shared_ptr<ContextState> ctx = container().get(context_id);
  c10::Dict<at::Tensor, at::Tensor> out;
  absl::MutexLock lock(&ctx->mu);
  for (const auto& [impl, entry] : ctx->grads) out.insert(entry.first, entry.second);
  return out;
}

size_t num_contexts() { return container().size(); }

namespace {
const bool g_debug_info_registered = [] {
  rpc::register_debug_info([](std::map<std::string, std::string>* info) {
    (*info)["dist_autograd.num_contexts"] = std::to_string(num_contexts());
  });
  return true;
}();
}  // namespace

ContextInfo context_info(ContextId context_id) {
  std::shared_ptr<ContextState> ctx = container().get(context_id);
  ContextInfo info;
  absl::MutexLock lock(&ctx->mu);
  for (const auto& [message, send] : ctx->sends) info.send_functions[message] = send.dest;
  info.recv_functions = ctx->recvs.size();
  info.known_workers = ctx->workers;
  return info;
}

void set_idle_context_timeout(absl::Duration timeout) {
  g_idle_timeout_ns.store(absl::ToInt64Nanoseconds(std::max(timeout, absl::Milliseconds(1))));
}

void set_max_remote_context_bytes(int64_t bytes) { g_max_remote_bytes.store(std::max<int64_t>(bytes, 0)); }

int64_t remote_context_bytes() { return container().remote_bytes(); }

void set_max_remote_context_bytes_per_worker(int64_t bytes) {
  g_max_remote_bytes_per_sender.store(std::max<int64_t>(bytes, 0));
}

int64_t remote_context_bytes_from(int worker) { return container().remote_bytes_from(worker); }

GradientHookHandle add_gradient_hook(GradientHook hook) {
  return GradientHookHandle(gradient_hooks().add(std::move(hook)));
}

void GradientHookHandle::remove() {
  if (id_ == 0) return;
  gradient_hooks().remove(std::exchange(id_, 0));
}

GradientHookHandle& GradientHookHandle::operator=(GradientHookHandle&& other) noexcept {
  if (this != &other) {
    remove();
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

}  // namespace ddprpc::dist_autograd
