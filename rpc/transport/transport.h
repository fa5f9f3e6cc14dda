// How frames travel between workers, as the RPC agent sees it. The agent
// depends on this interface only; grpc_transport.h implements it over gRPC
// bidirectional streams, and another implementation (e.g. shared memory
// between processes of one host) can sit beside it.
//
// - A Channel is the caller's end of a connection to one peer: send() a
//   request frame, replies come to OnFrame, the end comes once to OnClose.
// - A Server accepts channels: each request frame is parsed, checked
//   (CheckRequest) and handed on with a Responder that sends exactly one
//   reply on the same connection.
// - The transport owns framing: frames go down and come up parsed (the
//   bytes and their limits are its business), and scheduling hints such as
//   `more_in_flight` are arguments of send(), carried with the frame.
//
// Every frame a transport delivers has been parsed and validated by the
// wire codec (rpc/wire/codec.h) within the transport's size limits. A
// connection that breaks a rule ends with an error; the process never does.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "rpc/core/security.h"
#include "rpc/wire/codec.h"

namespace ddprpc::rpc::transport {

using internal::Frame;

// Settings of a transport as a whole, fixed when it is made. The defaults
// change nothing outside the transport's own work.
struct TransportOptions {
  // The threads the transport starts run as SCHED_BATCH
  // (rpc/internal/thread_policy.h).
  bool batch_scheduling = false;
  // A wait for a peer's message looks for up to this long before it sleeps
  // (spin_budget.h; at most kMaxSpinUs): on the same-host transport while
  // the job's workers on this host fit its CPUs, and on the gRPC
  // transport's completion queues (peers on other hosts) when this process
  // may use two CPUs or more. Zero: waits sleep at once.
  absl::Duration max_spin = absl::ZeroDuration();
  // Every frame read, requests and replies of either transport, is also
  // written into this directory, one file each named <kind>-<hash of its
  // bytes>, in the wire codec's format (what the fuzzers read). Empty: none.
  std::string capture_frames_dir;
};

// What one peer may make the server hold.
struct ServerLimits {
  int world_size = 1;  // connections name a worker id in [0, world_size)
  // The id of the worker this server belongs to (-1: none): proofs of the
  // token must name it as their destination.
  int self = -1;
  // Larger frames end their connection (RESOURCE_EXHAUSTED).
  int64_t max_message_bytes = int64_t{1} << 31;
  // Per connection: requests read and not yet answered; reading pauses there.
  int max_pending_requests = 1024;
  // Per connection: bytes of those requests (as on the wire, lent tensors
  // not counted); reading pauses above it (a request is always read whole).
  int64_t max_pending_request_bytes = int64_t{256} << 20;
  // Per connection: bytes of replies waiting for the caller to read them;
  // reading pauses above it. (The same-host transport lends reply tensors
  // by address up to this many bytes unacknowledged, one at least, and
  // sends the rest inline.)
  int64_t max_pending_reply_bytes = int64_t{64} << 20;
  // Open connections naming the same worker (a caller reopens a broken one).
  int max_streams_per_worker = 4;
  // Liveness pings to callers silent this long; unanswered for
  // keepalive_timeout, the caller's connections end (UNAVAILABLE).
  absl::Duration keepalive_interval = absl::Seconds(2);
  absl::Duration keepalive_timeout = absl::Seconds(5);
  // A request run inline by the reading thread for about this long hands
  // reading (of every connection, and of the request's own) to another
  // thread, so that a request that blocks stops no connection (see
  // RpcBackendOptions).
  absl::Duration inline_handoff = absl::Milliseconds(10);
  // Bytes the transport may buffer for all connections together: what
  // bounds the memory of a message that claims to be huge.
  int64_t max_buffered_bytes = int64_t{8} << 30;
  // The same, for the frames of one worker (all its connections); 0:
  // max_message_bytes. (The same-host transport counts a frame's bytes,
  // inline or copied from the sender's memory, from when its preamble is
  // read until it is whole; a frame that would pass either bound ends its
  // connection, RESOURCE_EXHAUSTED.)
  int64_t max_buffered_bytes_per_peer = 0;
  // Connections that have not proven themselves yet (their handshake runs):
  // at most this many at once, all together and per peer (the peer's uid on
  // the same-host socket). A new one beyond either count pushes out the
  // oldest such connection (of that peer first), so silent connections
  // cannot keep the job's own out. A handshake not done within
  // handshake_timeout ends its connection.
  int max_unauthenticated_connections = 64;
  int max_unauthenticated_per_peer = 16;
  absl::Duration handshake_timeout = absl::Seconds(10);
  // Same-host socket: processes of another uid than this one's are refused
  // as soon as they connect (the kernel names the uid: SO_PEERCRED), before
  // anything they send is read, unless this is set.
  bool allow_other_uids = false;
  // Requests may name tensors lent on the caller's bulk path
  // (wire::TensorMeta.lent), left for a bulk transport above this one to
  // pull (bulk_transport.h). Otherwise such a request is malformed.
  bool accept_lent_tensors = false;
};

// How a Channel connects.
struct PeerOptions {
  int self = 0;  // this worker's id, proven to the peer with the job's token
  int peer = -1;  // the id of the worker connected to, named by the proof
  // Replies larger than this end the channel.
  int64_t max_message_bytes = int64_t{1} << 31;
  // A ping goes to the peer after this much silence; unanswered for
  // keepalive_timeout, the channel ends as unreachable: a peer that
  // stopped, died without closing or was cut off is found within seconds.
  absl::Duration keepalive_interval = absl::Seconds(2);
  absl::Duration keepalive_timeout = absl::Seconds(5);
  // The job's token and TLS material.
  Security security;
  // The peer's Server::same_host_endpoint(), empty if it has none: a
  // transport that can reach that endpoint may connect there instead.
  std::string same_host_endpoint;
  // Replies may name lent tensors (as ServerLimits::accept_lent_tensors).
  bool accept_lent_tensors = false;
};

struct SendOptions {
  bool expects_reply = true;  // the peer answers the frame with one frame
  // The caller has other requests to this peer awaiting replies: the
  // peer's reader hands reading on before running this one.
  bool more_in_flight = false;
  // When the caller stops waiting for the reply (its call's deadline):
  // what the frame leaves with the sender for the peer to fetch (the bulk
  // path's lent tensors) is kept at least that long.
  absl::Time deadline = absl::InfinitePast();
};

// Why a channel ended.
struct CloseReason {
  bool ok = true;            // closed by close() or by the peer, not failed
  bool unreachable = false;  // the connection failed (peer dead, stopped or cut off)
  std::string message;
};

// Sends the single reply to one request. Dropping it unsent counts the
// request as answered (e.g. one-way notices).
class Responder {
 public:
  virtual ~Responder() = default;
  virtual void send(Frame reply) = 0;
  // True once send() was called (from any thread).
  virtual bool answered() const = 0;
  // The worker the request's connection belongs to, and its address.
  virtual int caller() const = 0;
  virtual const std::string& address() const = 0;
};

// How long a graceful close waits for its channel's end (Channel::close).
inline constexpr absl::Duration kGracefulCloseWait = absl::Seconds(5);

class Channel {
 public:
  // A reply frame; a non-OK status ends the channel with it (a reply that
  // breaks the protocol). Must not throw: an exception ends it too.
  using OnFrame = std::function<absl::Status(Frame)>;
  // Called once when the channel ends.
  using OnClose = std::function<void(const CloseReason&)>;

  virtual ~Channel() = default;
  // Queues a frame; false when the channel is closed or broken. Framing
  // and the size checks happen here, on the calling thread.
  virtual bool send(Frame frame, const SendOptions& options) = 0;
  virtual bool broken() const = 0;
  // Reads replies of this channel (and of others read the same way) on
  // this thread until done() or `deadline`, as Transport::drive does: a
  // caller waiting for a reply reads it itself.
  virtual void drive(const std::function<bool()>& done, absl::Time deadline) = 0;
  // An idle channel learns that its connection died only from its next
  // operation: if the connection is gone, this ends the channel (OnClose)
  // now. Cheap.
  virtual void check_connection() = 0;
  // graceful: let the peer end the connection (at most kGracefulCloseWait);
  // otherwise cancel at once. Returns once no callback of the channel runs
  // any more.
  virtual void close(bool graceful) = 0;
  // The first half of a graceful close, without waiting: no more frames
  // go out (send() fails), and the 5 s start now. A program closing
  // many channels calls this on each, then close(true) on each, and waits
  // about 5 s in all rather than 5 s per channel. (Over gRPC the peer
  // learns that no more requests come; a same-host channel's graceful
  // close waits only for its own queued writes to go out.)
  virtual void begin_close() {}
};

class Server {
 public:
  virtual ~Server() = default;
  virtual int port() const = 0;
  // Where peers on this host may connect besides host:port() (opaque to
  // the agent, which publishes it); empty if nowhere.
  virtual std::string same_host_endpoint() const { return {}; }
  // Where this server lends tensors from (bulk_transport.h: host:port of
  // its bulk listener), published like same_host_endpoint(); empty if
  // nowhere.
  virtual std::string bulk_endpoint() const { return {}; }
  // Ends all connections. Those whose callers are still connected get at
  // most `grace` to answer what they have read.
  virtual void shutdown(absl::Duration grace) = 0;
};

// ---------------------------------------------------------------------------
// The reading-role protocol (both transports, both sides)
//
// A connection is read by one thread at a time, the holder of its reading
// role, and on the caller's side the caller reads its own reply: a reply wakes
// only the thread that wants it, with no hop through a reader thread.
//
// Roles. On gRPC every PeerStream of a transport posts to one completion queue
// (ClientQueue) with one role (reader_, the holding thread). On the same host each
// SameHostChannel has its own role (holder_); a transport's channels share a
// ReadGate. A role is held by a waiting caller, the background reader
// (ClientQueue::background_ or the channel's thread), the same-host
// check_connection() on the timer thread (a free role only), or a closing gRPC
// stream when nobody else reads. Each server has one role for all its
// connections (internal/reading_role.h).
//
// Becoming the reader. RpcAgent::send_request gives each call's future a
// FutureDriver: Channel::drive on the call's channel until the future
// completes or the call's deadline. Future::wait, value and wait_for run the
// thread's held work, then the driver, then sleep on the future;
// rpc::wait_all, rpc::collect_all and then() pass an input's driver on.
// ClientQueue::drive takes the role if it is free and reads in 50 ms slices;
// if another thread holds it, the waiter counts itself in want_role_ and
// sleeps until the role is free or its future is done. The background reader
// yields after its current event when someone wants the role; a caller keeps
// it until its own wait ends. drive_same_host claims every free channel of the
// gate and keeps them until its wait ends (letting them go between polls would
// wake their background readers), polling their sockets and its own eventfd;
// if others hold every role, it waits for the gate's version to move.
//
// Reservations. In a SyncCallScope the first call reserves reading before its
// request goes (Transport::reserve_reading). While any reservation is held the
// background readers stay off (the whole gRPC queue, every channel of the
// gate), so the reply waits for its caller. rpc::rpc_sync, RRef::rpc_sync,
// RRef::to_here, HybridModel's lookups, DistributedOptimizer::step and
// dist_autograd::backward open one. The same-host transport reserves both
// transports, since a scope does not know which its calls use; a wait on one
// kind lends the thread's reservations of the other kind back (Lend), so that
// the other's background reader reads what the wait may depend on.
//
// Other replies. The holder handles every reply it reads: RpcAgent::on_reply
// completes that call's future, whose callbacks run on the reading thread.
// That reply's waiter wakes: on gRPC its condition is checked under the
// queue's mutex after each event; on the same host the reader writes every
// other driver's eventfd (ReadGate::wake_drivers). A reply on one transport
// wakes the readers of the other too (interrupt_drive(): a gRPC alarm that
// fires at once). A driving thread holds no work back (HeldWork::Suspend):
// async-execution replies its callbacks complete go out at once, as one may be
// what it waits for.
//
// Giving the role back. A waiter lets its roles go when its future completes
// or its deadline passes (read_if_free clears reader_; drive_same_host
// releases what it claimed and moves version). Callers that want a role get it
// before the background reader, which reads only while nobody wants the role,
// no reservation is held and replies are outstanding. ~SyncCallScope releases
// the reservation, so that replies of calls nobody waits for (callbacks only)
// are read again. A callback that waits for another call on the reading thread
// reads on under the role it holds (nested: the role's recorded holder is
// this thread) and keeps it after.
//
// Rules for a new kind of wait.
//
// 1. Wait on an rpc::Future. A future you complete yourself needs a driver:
//    copy a call's (set_driver(f.driver()), as rpc::wait_all does) or chain
//    with then(). A wait on a mutex, a condition variable or a sleep reads
//    nothing; on a thread that holds a role, it stops every reply that role
//    would read until it ends.
// 2. Never block in a future's callback except on a future: it runs on the
//    reading thread.
// 3. Open a SyncCallScope before the first call of a thread that will wait at
//    once, and inside it wait only for those calls: it keeps all of the
//    agent's background readers off.
// 4. In a request handler, call rpc::send_completed_replies() before blocking
//    on anything but a future: replies the handler completed are held until it
//    returns or waits, and one may be what it waits for.
// 5. A new source of completions outside the transports should call
//    Transport::interrupt_drive(), or readers see it only at their next 50 ms
//    slice.
// 6. A FutureDriver must not throw and must return by its until.
//
// ddp::ProcessGroup::allreduce_and_wait is the same idea for collectives: a
// caller that would wait at once runs the allreduce itself when the group's
// queue is idle (OpQueue::run_now), so the group's thread is neither woken nor
// waited for. DistributedDataParallel uses it for a single bucket.
//
// Who holds what. A role's holder and a thread's reservations are recorded,
// by thread id and under the owner's mutex, on the object they belong to:
// ClientQueue::reader_ (gRPC), SameHostChannel's holder_, and the gate's
// drivers (each with the eventfd that wakes it; a nested drive counts once)
// and reserved_by (same host). A wait that finds the calling thread recorded
// as the holder nests instead of waiting for the role; Lend looks up the
// calling thread's reservations. Nothing of the protocol lives in
// thread-local storage.
//
// Thread-local storage holds only the innermost of each kind of RAII scope,
// for code that runs inside the scope and cannot be handed it (a request
// handler, a future's callback, a Future::wait in user code), as PyTorch
// keeps its dist-autograd context and profiler state per thread:
//
// - t_sync_scope (rpc/agent.cc): the innermost SyncCallScope; a call sent
//   under it reserves reading.
// - HeldWork::current_ (rpc/core/internal/held_work.h): holds the async
//   replies a handler completes until it returns or waits; null while the
//   thread drives.
// - t_current_call (rpc/internal/callee.cc): the request being served; an
//   async reply completed outside held work is then written at once, not by
//   the reply sender.
// - t_wait_all_scope (rpc/rpc.cc): the innermost WaitAllScope, which collects
//   the futures of rpc::rpc_async.
// - t_current (autograd/dist_autograd.cc): the current context; a call under
//   it that carries tensors requiring grad records a send function.
// - t_state (rpc/profiler/profiler.cc): the profiler recorders pushed on this
//   thread: whether its operators are recorded, and where.
//
// One more is a cache, not a scope: SpinPoll::this_thread(max_ns)
// (rpc/transport/internal/spin_poll.cc), the thread's adaptive spin budget
// under the transport's maximum (TransportOptions::max_spin, 0 unless
// asked). It changes how long a poll looks before it sleeps, not what the
// wait does.
//
// The servers' side of the role (one role per server, its threads and its
// watchdog) is rpc/transport/internal/reading_role.h.
// ---------------------------------------------------------------------------

class Transport {
 public:
  using OnRequest = std::function<void(std::shared_ptr<Responder>, Frame)>;
  // A parsed request from worker `caller`'s connection; a non-OK status
  // ends that connection with it (e.g. a frame of the wrong kind).
  using CheckRequest = std::function<absl::Status(int caller, const Frame& frame)>;

  virtual ~Transport() = default;

  // Listens on host:0. Each request that passes `check` is passed either to
  // `run_inline`, which serves it on the reading thread, or to `offload`,
  // which must hand it to another thread (the caller said more of its
  // requests are in flight, or the reader is busy). Neither should throw;
  // if one does, the connection ends. With an authenticated `security`, a
  // connection must prove the job's token for the worker it names before
  // anything it sends is read. Throws RpcError if it cannot listen.
  virtual std::unique_ptr<Server> listen(const std::string& host, const ServerLimits& limits,
                                         const Security& security, CheckRequest check,
                                         OnRequest run_inline, OnRequest offload) = 0;

  // Opens a channel to the server at `address` (host:port). Never blocks:
  // a failure to connect ends the channel (OnClose, unreachable).
  virtual std::shared_ptr<Channel> connect(const std::string& address,
                                           const PeerOptions& options, Channel::OnFrame on_frame,
                                           Channel::OnClose on_close) = 0;

  // Replies are read by a caller waiting for one (drive()), so that a reply
  // needs no thread hop, or else by a background thread of the transport.
  // While reservations are held, the background thread leaves reading to
  // the callers that will wait (rpc::SyncCallScope).
  virtual void reserve_reading() = 0;
  virtual void release_reading() = 0;
  // Reads replies on this thread until done() or `deadline`.
  virtual void drive(const std::function<bool()>& done, absl::Time deadline) = 0;
  // Makes threads reading in drive() look at their done() now: something
  // else (e.g. another transport's reply) may have completed what they wait
  // for. Cheap when nobody drives.
  virtual void interrupt_drive() {}
  // Once the world is known: every worker's Server::same_host_endpoint()
  // and Server::bulk_endpoint() (this one's included), by rank. A
  // transport may tune itself to them.
  virtual void world_known(const std::vector<std::string>& same_host_endpoints,
                           const std::vector<std::string>& bulk_endpoints) {}

  // Whether something accepts connections at `address` now (after a peer
  // stopped serving RPCs: is its process still there).
  virtual bool probe(const std::string& address, const PeerOptions& options,
                     absl::Time deadline) = 0;
};

// The transport workers use unless told otherwise: gRPC (grpc_transport.h).
std::shared_ptr<Transport> make_default_transport(const TransportOptions& options = {});

}  // namespace ddprpc::rpc::transport
