// Distributed autograd, mirroring torch.distributed.autograd:
//
//   {
//     dist_autograd::Context context;            // `with dist_autograd.context()`
//     at::Tensor loss = model(...);               // may cross RPCs
//     dist_autograd::backward(context.id(), {loss});
//     auto grads = dist_autograd::get_gradients(context.id());
//   }                                             // released on every worker
//
// (Other workers learn of the release with the next call this process makes
// to them, or in a call of its own after 20 ms; a release whose call fails
// rides again, up to 3 times.)
//
// Inside a context, every RPC that carries tensors requiring grad (arguments
// or results, nested calls and RRef method calls included) records a send
// function on the sender and a recv function on the receiver. backward() runs
// FAST mode: the local engine from the roots, then each recv function's
// gradients go back to the worker that sent the tensors, which continues from
// the matching send function; it returns when every worker involved is done
// and throws the first remote error. Gradients accumulate in the context, per
// worker, never in .grad. The result equals local autograd's:
// - a node reached through several send functions (a tensor used here and
//   also sent on in a nested call, one received tensor passed to two calls)
//   runs once per pass on that pass's share of the gradient (backward
//   functions are linear in it); the passes keep the saved tensors, which the
//   context's release frees unless backward was asked to retain the graph;
// - hooks on tensors run, leaves' and received tensors' included.
// Unlike PyTorch's FAST mode, backward also completes when an RPC's result
// is not used by the loss (no gradient ever comes for its send function).
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <set>
#include <vector>

#include "absl/time/time.h"

namespace ddprpc::rpc {
template <typename T>
class RRef;
}  // namespace ddprpc::rpc

namespace ddprpc::dist_autograd {

using ContextId = int64_t;

// RAII distributed autograd context; requires RPC to be initialized. The id
// is unique across the job: worker id in the top 16 bits, a counter below.
// It is the current context of the constructing thread until destroyed; it
// may be used from other threads through its id.
class Context {
 public:
  Context();
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ContextId id() const { return id_; }

 private:
  ContextId id_;
  ContextId previous_;
};

// The current thread's context id, or -1. While a backward pass runs, that
// includes the threads libtorch's engine runs the pass's nodes on (a CUDA
// device's thread, where tensor hooks such as DDP's run), and any thread
// given the thread-local state of one of them, where libtorch carries a
// thread's debug info into its passes (c10::DebugInfoKind with named
// slots); with an older libtorch only the thread that runs the pass.
ContextId current_context_id();

// Runs the distributed backward pass from scalar `roots`.
void backward(ContextId context_id, const std::vector<at::Tensor>& roots,
              bool retain_graph = false);

// backward(id, {loss}): a braced list of tensors. Without this overload the
// list converts to the vector and, through RRef's explicit constructor, to
// an RRef, and g++ 13 rejects the call as ambiguous.
inline void backward(ContextId context_id, std::initializer_list<at::Tensor> roots,
                     bool retain_graph = false) {
  backward(context_id, std::vector<at::Tensor>(roots), retain_graph);
}

// RRef.backward(context_id): the distributed backward pass from the scalar
// tensor `root` holds, run by its owner (this worker or another) in
// `context_id`, in which the owner must have computed it (e.g. the RRef came
// from rpc::remote inside the context). Returns when the pass is done
// everywhere; throws the owner's error.
void backward(ContextId context_id, const rpc::RRef<at::Tensor>& root, bool retain_graph = false);

// Parameter -> accumulated gradient of `context_id` on this worker.
c10::Dict<at::Tensor, at::Tensor> get_gradients(ContextId context_id);

// Contexts alive on this worker (for leak checks).
size_t num_contexts();

// What this worker recorded of a context's graph (PyTorch's
// ctx._send_functions(), _recv_functions() and _known_worker_ids()).
struct ContextInfo {
  // Message id -> the worker its tensors went to, one per send function.
  std::map<int64_t, int> send_functions;
  // Recv functions: one per received message that carried tensors.
  size_t recv_functions = 0;
  // The other workers this context's messages (with tensors or not) came
  // from or went to.
  std::set<int> known_workers;
};
// Throws std::invalid_argument for a context this worker does not hold.
ContextInfo context_info(ContextId context_id);

// Contexts that messages of other workers created here are dropped once no
// message of theirs has come or gone for this long (their creator died, or
// its release was lost). Default 10 minutes.
void set_idle_context_timeout(absl::Duration timeout);

// Tensors requiring grad that other workers' messages bring into contexts
// they created can stay here, with what their graphs saved, until the
// context is released. Their bytes are counted as they arrive, whether or
// not a graph keeps them: all such contexts together may hold at most
// `bytes` (default 4 GiB). A message past it fails its call with
// ErrorCode::kResourceExhausted; a context released or dropped gives its
// bytes back.
void set_max_remote_context_bytes(int64_t bytes);
// Bytes of received tensors that contexts of other workers hold here now.
int64_t remote_context_bytes();
// The same bound on the bytes that any one worker's messages brought
// (default 1 GiB), so that a worker whose contexts stay alive, or that
// sends into contexts it names, takes at most that share of the bound
// above; with the defaults, four such workers still fill it.
void set_max_remote_context_bytes_per_worker(int64_t bytes);
// Bytes of tensors that worker id `worker`'s messages brought into
// contexts of other workers here, held now.
int64_t remote_context_bytes_from(int worker);

// Called after each local backward pass on this worker with the gradients
// that pass produced (`params` are the pass's leaves, `grads` their
// gradients, undefined for a leaf the pass gave none), before they are
// added to the context; a hook may replace gradients in `grads`, typically
// only those of the parameters it owns (DDP averages its module's parameters
// across replicas here). Several hooks may be registered at once: each pass
// calls them one after another, in the order they were added, each seeing
// what the earlier ones put in `grads`. An exception from a hook fails the
// pass. Passes run on engine and RPC threads, possibly several at once, so a
// hook may run concurrently with itself and with add_gradient_hook and
// removals.
using GradientHook =
    std::function<void(ContextId context_id, std::vector<at::Tensor>& params,
                       std::vector<at::Tensor>& grads)>;

// Owns one registration of add_gradient_hook. remove() (or the destructor)
// unregisters exactly that hook: no pass calls it once remove() has
// returned, and remove() waits for the calls already under way (a hook may
// remove itself; then only the other threads' calls are waited for).
class GradientHookHandle {
 public:
  GradientHookHandle() = default;
  ~GradientHookHandle() { remove(); }
  GradientHookHandle(GradientHookHandle&& other) noexcept : id_(other.id_) { other.id_ = 0; }
  GradientHookHandle& operator=(GradientHookHandle&& other) noexcept;
  GradientHookHandle(const GradientHookHandle&) = delete;
  GradientHookHandle& operator=(const GradientHookHandle&) = delete;

  // Whether it still holds a registration.
  bool active() const { return id_ != 0; }
  void remove();

 private:
  friend GradientHookHandle add_gradient_hook(GradientHook hook);
  explicit GradientHookHandle(int64_t id) : id_(id) {}
  int64_t id_ = 0;
};

// Registers `hook` (not null) after the hooks registered already; it stays
// registered as long as the returned handle holds it.
[[nodiscard]] GradientHookHandle add_gradient_hook(GradientHook hook);

}  // namespace ddprpc::dist_autograd
