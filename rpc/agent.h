// RpcAgent: one worker's RPC endpoint (what PyTorch calls the RPC agent).
//
// Created by rpc::init_rpc, or directly (several agents may live in one
// process). It rendezvouses through the Store, serves registered functions
// (and the internal functions of extensions, extension.h) on a pool of
// num_worker_threads, sends requests over a transport channel per peer
// (rpc/transport/transport.h; gRPC by default), and fails every call that
// cannot complete with an RpcError naming the worker and the function:
// timeouts, dead peers, oversized messages, unknown functions, bad
// arguments, remote exceptions, shutdown.
#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/core/future.h"
#include "rpc/registry.h"
#include "rpc/rendezvous/store.h"
#include "rpc/core/security.h"
#include "rpc/worker.h"

namespace ddprpc::rpc {

class RpcHook;

class AgentExtension;

namespace internal {
struct Frame;
class Callee;
struct ExtensionCodec;
class ThreadPool;
}  // namespace internal

namespace transport {
struct PeerOptions;
class Channel;
class Responder;
class Server;
class Transport;
}  // namespace transport

// Sentinel for "the agent's default rpc_timeout".
inline constexpr absl::Duration kDefaultTimeout = absl::Seconds(-1);

struct RpcBackendOptions {
  // How many requests may run at once (functions returning a Future count
  // until they return it). A request runs on the stream thread that read
  // it when one of these slots is free, else on a pool of this many threads.
  int num_worker_threads = 16;
  // Default deadline of every call; zero or infinite means none.
  absl::Duration rpc_timeout = absl::Seconds(60);
  // How long a graceful shutdown waits for the other workers to reach
  // shutdown too. Workers found dead or unreachable are not waited for.
  absl::Duration shutdown_timeout = absl::InfiniteDuration();
  // Liveness of every connection, both ways: an HTTP/2 ping after
  // keepalive_interval of silence; unanswered for keepalive_timeout, the
  // peer counts as dead and the calls waiting on it fail (UNAVAILABLE). A
  // peer that is only slow still answers pings.
  absl::Duration keepalive_interval = absl::Seconds(2);
  absl::Duration keepalive_timeout = absl::Seconds(5);
  // "tcp://host:port" (rank 0 hosts the store there) or "env://", which reads
  // MASTER_ADDR and MASTER_PORT.
  std::string init_method = "env://";
  // Address this worker listens on and advertises to the others.
  std::string listen_address = "127.0.0.1";
  // Largest request or response, in bytes; larger ones fail with
  // kMessageTooLarge. Checked by the sender and again by the receiver.
  int64_t max_message_bytes = int64_t{1} << 31;
  // What one peer may make this worker hold (larger amounts pause reading
  // its stream, or are refused with kResourceExhausted): requests read and
  // not yet answered, per stream, and their bytes (past them reading waits
  // for answers; one request is always read whole); bytes of replies it
  // has not read yet, per stream; requests waiting for a worker thread, all
  // callers together.
  int max_pending_requests_per_stream = 1024;
  int64_t max_pending_request_bytes_per_stream = int64_t{256} << 20;
  int64_t max_pending_reply_bytes = int64_t{64} << 20;
  int max_queued_requests = 1 << 16;
  // Who may connect (security.h): the job's token and TLS material; what
  // is left empty comes from the environment (DDPRPC_AUTH_TOKEN,
  // DDPRPC_AUTH_TOKEN_FILE, DDPRPC_TLS_CERT/KEY/CA). A worker that listens
  // or meets the store on an address other than loopback refuses to start
  // without a token or TLS, unless allow_insecure (then it warns).
  Security security;
  bool allow_insecure = false;
  // Connections that have not proven the token yet (docs/security.md): at
  // most this many at once on each of this worker's servers, all together
  // and per peer (the oldest give way to new ones), each ended after
  // handshake_timeout. Processes of other users of this host may use the
  // same-host socket only with allow_other_uids.
  int max_unauthenticated_connections = 64;
  int max_unauthenticated_per_peer = 16;
  absl::Duration handshake_timeout = absl::Seconds(10);
  bool allow_other_uids = false;
  // Bytes of received messages this worker buffers for all peers together;
  // 0: four times max_message_bytes, at least 256 MiB. gRPC checks a
  // message's size only once all of it has arrived, so this is what bounds
  // one that claims to be huge: past it gRPC cancels streams (its choice;
  // calls on them fail with kUnavailable and the next ones reconnect).
  // On the same-host transport it bounds the bytes of the frames being
  // read, all peers together (one peer: max_message_bytes); a frame past
  // either ends its connection (kResourceExhausted).
  int64_t max_receive_buffer_bytes = 0;
  // A request that the thread reading this worker's streams runs itself
  // (its caller had no other call to this worker in flight) and that runs
  // longer than about this (it blocks, or waits for a later request)
  // hands the reading of the streams to another thread. Shorter requests,
  // of every caller, run there one after another without a thread switch.
  // Requests that arrive while others of their caller are in flight are
  // handed on at once, whatever this says.
  absl::Duration inline_request_handoff = absl::Milliseconds(10);
  // Peers on this host (same boot and namespaces) are reached through the
  // same-host transport (rpc/transport/same_host_transport.h: a Unix socket,
  // large tensors copied once from the sender's memory), others over gRPC.
  bool same_host_transport = true;
  // Tensors of at least bulk_min_bytes between workers on different hosts
  // leave their frame: the receiver pulls them from the sender over TCP
  // connections of their own, bulk_streams at once, straight into the new
  // tensor (rpc/transport/bulk_transport.h). Off with TLS (tensors stay
  // on the encrypted stream) or when bulk_min_bytes is 0.
  uint64_t bulk_min_bytes = 256 << 10;
  int bulk_streams = 3;
  // Where this process may use bulk_push_min_cpus CPUs or more, the sender
  // starts pushing such a tensor's bytes as it lends it, over bulk_streams
  // connections of its own to the receiver, when they are open and idle;
  // the receiver takes them straight into the tensor once the frame that
  // names them is checked, and pulls what does not come. (On fewer CPUs the
  // pushed bytes delay the frame that names them, and pulling is faster.)
  bool bulk_push = true;
  int bulk_push_min_cpus = 4;
  // Pulled tensors take their memory from buffers that earlier ones gave
  // back, pages still resident, keeping at most this many bytes of buffers
  // no tensor uses, each for at most 10 s (0: the CPU allocator's memory,
  // whose fresh pages fault in one by one as the bytes land).
  int64_t bulk_receive_cache_bytes = int64_t{128} << 20;
  // The agent's threads (stream readers, the worker pool, the timer) run
  // as SCHED_BATCH: a message that wakes one does not preempt the thread
  // running on its core. On a host with more runnable threads than cores,
  // a worker answering many callers at once (a batch, a fan-out) sends
  // every reply before the callers it wakes take its core. Threads started
  // from them (a handler's, libtorch's intra-op pool) inherit it. Off by
  // default: it changes how the program's own work is scheduled.
  bool batch_scheduling = false;
  // A wait for a peer's message looks for it for up to this long before it
  // sleeps (at most 10 ms): for a peer on this host while the job's workers
  // on this host have a CPU each, for a peer on another host (gRPC) when
  // this process may use two CPUs or more. A thread's allowance halves
  // after each wait that outlasted twice this long (a wait that ended
  // sooner fills it again), so threads that wait long stop spinning. It
  // saves the wake-up of a sleeping thread (tens of microseconds on a VM)
  // and costs CPU time: zero by default.
  absl::Duration max_spin = absl::ZeroDuration();
  // Every frame this worker reads (requests and replies, either transport)
  // is also written into this directory, e.g. to seed the fuzzers
  // (TransportOptions::capture_frames_dir). Empty: none.
  std::string capture_frames_dir;
};

// Within its scope, this thread waits (Future::wait, value, wait_for,
// wait_all) for the calls it makes before the scope ends, as rpc_sync,
// RRef::rpc_sync, RRef::to_here and fan-outs waited with wait_all do. The
// waiting thread then reads the replies itself, and the client queue's
// background reader is not woken for them; replies of calls nobody waits
// for (callbacks only) are read once the scope ends or a thread waits.
class SyncCallScope {
 public:
  SyncCallScope();
  ~SyncCallScope();
  SyncCallScope(const SyncCallScope&) = delete;
  SyncCallScope& operator=(const SyncCallScope&) = delete;

 private:
  friend class RpcAgent;
  SyncCallScope* const saved_;
  // The queue this scope holds the background reader off (the first call's).
  std::weak_ptr<transport::Transport> reserved_;
};

class RpcAgent {
 public:
  // Rendezvous with world_size workers; throws RpcError on failure (for
  // instance a duplicate name or a store that never comes up).
  // Requests that arrive before start_serving() wait for it; with
  // serve_now it is called at the end of construction. (init_rpc first
  // installs the agent as current, so functions can use the global API.)
  RpcAgent(const std::string& name, int rank, int world_size, RpcBackendOptions options,
           const FunctionRegistry* registry = &FunctionRegistry::global(), bool serve_now = true);
  void start_serving();
  // Shuts down without waiting if shutdown() was not called.
  ~RpcAgent();
  RpcAgent(const RpcAgent&) = delete;
  RpcAgent& operator=(const RpcAgent&) = delete;

  const WorkerInfo& self() const { return workers_[rank_]; }
  const std::vector<WorkerInfo>& workers() const { return workers_; }
  // Throws RpcError(kInvalidArgument) for an unknown name or id.
  const WorkerInfo& worker(const std::string& name) const;
  const WorkerInfo& worker(int id) const;
  const RpcBackendOptions& options() const { return options_; }
  // The deadline of calls made without one (kDefaultTimeout): starts as
  // options().rpc_timeout; set_rpc_timeout changes it for calls made from
  // then on (calls in flight keep theirs). Zero or infinite: no deadline.
  absl::Duration rpc_timeout() const;
  void set_rpc_timeout(absl::Duration timeout);
  // Counters of this worker, by name ("agent.num_pending_calls",
  // "agent.idle_worker_threads", "rref.owned", ...).
  std::map<std::string, std::string> debug_info() const;
  Store& store() { return *store_; }
  // The extension registered as `name` (extension.h), or nullptr when the
  // process links none of that name.
  std::shared_ptr<AgentExtension> extension(const std::string& name) const;
  // Runs `fn` on the agent's timer thread at `when`, unless the agent stops
  // first. `fn` must not block.
  void run_at(absl::Time when, std::function<void()> fn);

  // Calls `function` on worker `to`. Errors name the call as
  // api('display') ("rpc_sync('add')"); display defaults to the function.
  // Never throws: errors fail the future.
  Future<c10::IValue> call(int to, const std::string& function, std::vector<c10::IValue> args,
                           absl::Duration timeout = kDefaultTimeout, const char* api = "rpc",
                           const std::string& display = "");
  // One-way message: no reply, no completion; failures are only logged.
  void notify(int to, const std::string& function, std::vector<c10::IValue> args);

  // False once a connection to worker `id` failed (keepalive found it
  // stopped, dead or cut off; it refused to connect), until it answers a
  // call again. Calls to it are still tried.
  bool is_reachable(int id) const;

  // graceful: waits for this worker's outstanding calls and for every other
  // worker to reach shutdown, then stops; bounded by rpc_timeout even if a
  // peer died. Otherwise fails pending calls and stops at once. Returns
  // true only for a graceful shutdown that met every other worker within
  // shutdown_timeout (none found dead or unreachable) after every call of
  // this worker ended; false otherwise (what went wrong is logged), and
  // when the agent was stopped already.
  bool shutdown(bool graceful = true);
  bool running() const;

  // Requests whose function is running right now (on any thread); async
  // functions waiting on their future do not count.
  int busy_worker_threads() const;

 private:
  struct PendingCall {
    Future<c10::IValue> future;
    int to;
    std::string function;  // as shown in errors
    const char* api;
    absl::Time deadline;
    // The stream it went out on (PeerSlot::generation); 0 until sent.
    uint64_t stream = 0;
    // Hooks that took part in this call (rpc/hooks.h) and their state.
    std::vector<std::pair<RpcHook*, std::shared_ptr<void>>> hooks;
  };
  struct PeerSlot {
    absl::Mutex mu;
    std::shared_ptr<transport::Channel> stream ABSL_GUARDED_BY(mu);
    // Set once `stream` has reported its end (OnClose).
    std::shared_ptr<std::atomic<bool>> ended ABSL_GUARDED_BY(mu);
    // Counts the streams opened to the worker; `stream` is the latest.
    std::atomic<uint64_t> generation{0};
  };
  struct BrokenStream {
    std::shared_ptr<transport::Channel> stream;
    std::shared_ptr<std::atomic<bool>> ended;
  };
  // Lets a thread waiting for a call fail it at its deadline itself, for
  // as long as the agent exists.
  struct Expiry {
    absl::Mutex mu;
    RpcAgent* agent ABSL_GUARDED_BY(mu);
    // Fails call `id` with its timeout, if it is still pending.
    void expire(uint64_t id);
  };

  Future<c10::IValue> send_request(int to, const std::string& function,
                                   std::vector<c10::IValue> args, absl::Duration timeout,
                                   const char* api, const std::string& display, bool one_way);
  void rendezvous(const std::string& name, int world_size);
  // Publishes "<prefix>/<rank>" and, if `wait`, waits until every other
  // worker published it or is found dead. False if it gave up at `timeout`.
  bool store_barrier(const std::string& prefix, bool wait, absl::Duration timeout);
  bool peer_alive(int id) const;
  // Which of `ids` answer now (in parallel, at most about a second).
  std::vector<bool> peers_alive(const std::vector<int>& ids);
  // The open stream to `to` (opened anew if broken); nullptr once stopped.
  std::shared_ptr<transport::Channel> peer(int to, uint64_t* generation = nullptr);
  // How to connect to worker `to` (-1: to its address only).
  transport::PeerOptions peer_options(int to) const;
  // Serves a request on a pool thread (when the stream's threads are busy).
  void offload(std::shared_ptr<transport::Responder> responder, internal::Frame frame);
  void serve(const std::shared_ptr<transport::Responder>& responder, internal::Frame& frame,
             absl::Time received);
  // A reply from worker `from`; an error status if it breaks the protocol.
  absl::Status on_reply(int from, internal::Frame frame);
  // `unreachable`: the connection failed, not closed.
  // Fails the calls that went out on stream `generation` of `peer`, or on
  // an older one, or are not sent yet; calls on a newer stream go on.
  void on_peer_closed(int peer, const std::string& why, bool unreachable, uint64_t generation);
  // check_connection() of every open stream.
  void check_connections();
  void fail_pending(const std::vector<PendingCall>& calls, ErrorCode code, const std::string& why);
  // Removes the call at `it` from pending_, deadlines_ and in_flight_.
  PendingCall take_pending(absl::flat_hash_map<uint64_t, PendingCall>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string describe(const PendingCall& call) const;
  void timer_loop();
  // Takes call `id` from the pending calls and ends it (end_expired), if
  // it is still pending; `*why` is its timeout error.
  std::optional<PendingCall> take_expired(uint64_t id, std::string* why);
  // Ends the hooks of a call whose deadline passed (taken from the pending
  // calls); returns its timeout error.
  std::string end_expired(const PendingCall& call);
  // Slots bounding concurrent requests to num_worker_threads.
  bool try_acquire_worker();
  void acquire_worker();
  void release_worker();
  void stop(bool graceful);

  const int rank_;
  const RpcBackendOptions options_;  // options_.security holds the environment's defaults too
  const FunctionRegistry* const registry_;
  // Fixed once the constructor returns.
  std::vector<WorkerInfo> workers_;
  std::vector<std::string> same_host_endpoints_;  // by worker id; empty: none
  std::vector<std::string> bulk_endpoints_;       // by worker id; empty: none
  std::unique_ptr<StoreServer> store_server_;  // rank 0 only
  std::unique_ptr<Store> store_;
  // Moves the frames; created before the server and the channels, which
  // must be gone before it goes.
  std::shared_ptr<transport::Transport> transport_;
  std::unique_ptr<transport::Server> server_;
  std::unique_ptr<internal::ThreadPool> pool_;
  // Sends the replies of calls whose futures complete after their handler
  // returned (async execution). Lives as long as the agent.
  std::unique_ptr<internal::ThreadPool> reply_sender_;
  // Extensions (extension.h) by name, made before the server starts, and
  // the codec of their values in messages.
  std::vector<std::pair<std::string, std::shared_ptr<AgentExtension>>> extensions_;
  std::vector<internal::ExtensionCodec> extension_codecs_;
  std::unique_ptr<internal::Callee> callee_;
  std::vector<std::unique_ptr<PeerSlot>> peers_;
  // Workers a shutdown barrier found gone (used by the thread shutting down).
  std::set<int> left_;
  std::atomic<int64_t> rpc_timeout_ns_;  // rpc_timeout(); INT64_MAX: infinite
  std::thread timer_;
  std::atomic<bool> shutting_down_{false};
  const std::shared_ptr<Expiry> expiry_ = std::make_shared<Expiry>();
  mutable absl::Mutex workers_mu_;
  int free_workers_ ABSL_GUARDED_BY(workers_mu_) = 0;

  mutable absl::Mutex mu_;
  // State below is protected by mu_.
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, PendingCall> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<int> in_flight_ ABSL_GUARDED_BY(mu_);  // entries of pending_ per peer
  std::set<std::pair<absl::Time, uint64_t>> deadlines_ ABSL_GUARDED_BY(mu_);
  std::multimap<absl::Time, std::function<void()>> timers_ ABSL_GUARDED_BY(mu_);  // run_at()
  // Per worker: why it is unreachable ("" while it is reachable).
  std::vector<std::string> unreachable_ ABSL_GUARDED_BY(mu_);
  absl::Time next_connection_check_ ABSL_GUARDED_BY(mu_);
  // Streams that broke and have not reported their end yet; closed at
  // shutdown. Those that have are let go as others break.
  std::vector<BrokenStream> broken_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ddprpc::rpc
