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
  // A wait for a peer on this host (same-host transport) looks for up to
  // this long before it sleeps, while the job's workers on this host fit
  // its CPUs (spin_budget.h; at most kMaxSpinUs). Zero: waits sleep at once.
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
};

struct SendOptions {
  bool expects_reply = true;  // the peer answers the frame with one frame
  // The caller has other requests to this peer awaiting replies: the
  // peer's reader hands reading on before running this one.
  bool more_in_flight = false;
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
  // graceful: let the peer end the connection (at most 5 s); otherwise
  // cancel at once. Returns once no callback of the channel runs any more.
  virtual void close(bool graceful) = 0;
};

class Server {
 public:
  virtual ~Server() = default;
  virtual int port() const = 0;
  // Where peers on this host may connect besides host:port() (opaque to
  // the agent, which publishes it); empty if nowhere.
  virtual std::string same_host_endpoint() const { return {}; }
  // Ends all connections. Those whose callers are still connected get at
  // most `grace` to answer what they have read.
  virtual void shutdown(absl::Duration grace) = 0;
};

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
  // (this one's included), by rank. A transport may tune itself to it.
  virtual void world_known(const std::vector<std::string>& same_host_endpoints) {}

  // Whether something accepts connections at `address` now (after a peer
  // stopped serving RPCs: is its process still there).
  virtual bool probe(const std::string& address, const PeerOptions& options,
                     absl::Time deadline) = 0;
};

// The transport workers use unless told otherwise: gRPC (grpc_transport.h).
std::shared_ptr<Transport> make_default_transport(const TransportOptions& options = {});

}  // namespace ddprpc::rpc::transport
