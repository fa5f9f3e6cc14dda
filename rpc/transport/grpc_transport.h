// The gRPC implementation of the transport interface (transport.h): one
// bidirectional stream per (caller, callee) pair carries serialized frames
// (rpc/wire/codec.h) both ways.
//
// - TransportServer: accepts streams; each request frame is handed to the
//   agent with a Responder that sends exactly one reply on the same stream.
//   Both ends use gRPC's asynchronous API, each queue read by one thread at
//   a time, so that a message wakes one thread.
//   A stream belongs to the worker named in its initial metadata
//   (kWorkerMetadataKey); its frames must be requests or notices from that
//   worker. A stream that breaks a rule (malformed frame, wrong kind, other
//   source, over a size limit) ends with an error status and a log line
//   naming its address; the rest of the server is untouched. Reading a
//   stream pauses while it has ServerLimits' worth of requests unanswered or
//   replies unread, so a peer cannot make the server buffer without bound.
// - PeerStream: the caller's side of a stream; replies go to a callback,
//   run by a waiting caller or the background thread of the ClientQueue
//   that all of a process's streams share.
#pragma once

#include <grpcpp/alarm.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/async_stream.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/core/security.h"
#include "rpc/transport/transport.h"
#include "rpc/wire/codec.h"

namespace ddprpc::rpc::internal {

class ServerStream;

// Initial metadata of a stream: the caller's worker id, in decimal.
inline constexpr char kWorkerMetadataKey[] = "ddprpc-worker";

using transport::PeerOptions;
using transport::ServerLimits;

// The Responder of a request of `bytes` read from a ServerStream (counted
// against the stream's limits until it is answered or dropped).
class GrpcResponder : public transport::Responder {
 public:
  GrpcResponder(std::shared_ptr<ServerStream> stream, int64_t bytes);
  ~GrpcResponder() override;
  GrpcResponder(const GrpcResponder&) = delete;
  GrpcResponder& operator=(const GrpcResponder&) = delete;
  void send(Frame reply) override;
  bool answered() const override;
  int caller() const override { return caller_; }
  const std::string& address() const override { return address_; }

 private:
  std::shared_ptr<ServerStream> stream_;
  const int64_t bytes_;
  const int caller_;
  const std::string address_;
  std::atomic<bool> answered_{false};
};

class TransportServer : public transport::Server {
 public:
  using OnRequest = transport::Transport::OnRequest;
  using CheckRequest = transport::Transport::CheckRequest;
  // Listens on host:0. Each request is passed either to `run_inline`, which
  // serves it on the calling (polling) thread, or to `offload`, which must
  // hand it to another thread (when the caller has more requests in flight).
  // Neither should throw; if one does, the stream ends with INTERNAL.
  // Throws RpcError if it cannot listen.
  // With an authenticated `security`, a stream must prove the job's token
  // for the worker it names (internal/auth.h) before anything it sends is
  // read; otherwise it ends with UNAUTHENTICATED and a log line naming its
  // address. With TLS, callers need a certificate from the job's CA.
  static std::unique_ptr<TransportServer> start(const std::string& host,
                                                const ServerLimits& limits,
                                                const Security& security, CheckRequest check,
                                                OnRequest run_inline, OnRequest offload,
                                                const transport::TransportOptions& options = {});
  ~TransportServer() override;
  int port() const override { return port_; }
  // Ends all streams. Those whose callers are still connected get at most
  // `grace` to answer what they have read; replies due on streams their
  // callers have closed are dropped.
  void shutdown(absl::Duration grace) override;

  class Service;

 private:
  TransportServer() = default;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

class PeerStream;

// The completion queue of all of a process's PeerStreams, read by one
// thread at a time (the reading role): a caller waiting for a reply
// (drive()), so that replies need no thread hop and one thread reads every
// stream a fan-out of calls waits on, or else the queue's background
// thread, which reads while operations are outstanding and no caller does.
class ClientQueue {
 public:
  // `options.capture_frames_dir`: where the streams' replies are captured.
  explicit ClientQueue(transport::TransportOptions options = {});
  // Drains the queue and joins the background thread; every stream must
  // have been closed.
  ~ClientQueue();
  ClientQueue(const ClientQueue&) = delete;
  ClientQueue& operator=(const ClientQueue&) = delete;

  // While reservations are held (SyncCallScope: callers that will wait for
  // their calls), the background thread leaves the queue to those callers.
  void reserve_reading();
  void release_reading();
  // Reads the queue on this thread, running the streams' events, until
  // done() or `deadline`. While another thread reads, waits for done() or
  // for the role (which that thread then hands over after its event).
  void drive(const std::function<bool()>& done, absl::Time deadline);
  // Wakes the thread reading the queue (an alarm that fires at once), so
  // that it looks at its done() now.
  void interrupt();

 private:
  friend class PeerStream;
  struct Tag {
    PeerStream* stream;
    int op;
  };
  grpc::CompletionQueue* cq() { return &cq_; }
  // Counts an operation about to be posted; its completion uncounts it.
  void will_post();
  // Reads (as drive()) if no other thread does, or nested if this thread
  // holds the role already (a callback it runs waits); false if another
  // thread holds it.
  bool read_if_free(const std::function<bool()>& done, absl::Time deadline);
  void run_events(const std::function<bool()>& done, absl::Time deadline);
  void background_loop();

  const transport::TransportOptions options_;
  // How long a wait for the queue's next event may look before it sleeps.
  const int64_t spin_ns_;
  grpc::CompletionQueue cq_;
  Tag alarm_tag_{nullptr, -1};
  absl::Mutex mu_;
  // State below is protected by mu_.
  int64_t pending_ ABSL_GUARDED_BY(mu_) = 0;  // posted operations not yet completed
  int reserved_ ABSL_GUARDED_BY(mu_) = 0;     // see reserve_reading()
  // The thread that holds the reading role; std::thread::id(): none.
  std::thread::id reader_ ABSL_GUARDED_BY(mu_);
  absl::Time last_interrupt_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // interrupt()'s alarm
  int want_role_ ABSL_GUARDED_BY(mu_) = 0;    // drive()rs waiting for it
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  bool drained_ ABSL_GUARDED_BY(mu_) = false;  // the queue returned SHUTDOWN
  std::unique_ptr<grpc::Alarm> alarm_ ABSL_GUARDED_BY(mu_);  // set by interrupt(), until it fires
  std::thread background_;  // last: starts after the state above exists
};

// The caller's end of a stream to one peer, on gRPC's asynchronous API,
// its completions read from a ClientQueue. The stream keeps itself alive
// while it has operations posted; close() it before letting it go.
class PeerStream : public transport::Channel {
 public:

  // `queue` must outlive the stream's operations (close() waits for them).
  static std::shared_ptr<PeerStream> open(const std::string& address, const PeerOptions& options,
                                          ClientQueue* queue, OnFrame on_frame, OnClose on_close);
  ~PeerStream() override;

  // Queues a frame; false when the stream is closed or broken.
  bool send(Frame frame, const transport::SendOptions& options) override;
  bool broken() const override;
  void drive(const std::function<bool()>& done, absl::Time deadline) override {
    client_queue_->drive(done, deadline);
  }
  // An idle stream (no read posted) learns that its connection died (e.g.
  // keepalive found the peer gone) only from its next operation: if the
  // connection is gone, this posts a read, whose failure ends the stream
  // (OnClose) now. Cheap: it looks at the channel's state.
  void check_connection() override;
  // graceful: half-close and wait (at most 5 s) for the peer to end the
  // stream; otherwise cancel at once. Returns once every operation of the
  // stream has completed: no callback runs after it.
  void close(bool graceful) override;
  // Half-closes now; a later close(true) waits until 5 s after this call.
  void begin_close() override;

 private:
  friend class ClientQueue;
  enum Op { kStart, kRead, kWrite, kWritesDone, kFinish, kNumOps };
  PeerStream(const std::string& address, const PeerOptions& options, ClientQueue* queue,
             OnFrame on_frame, OnClose on_close);
  // Counts operation `op` and returns its tag; the caller posts it (it may
  // do so after releasing mu_).
  void* post(Op op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs one completion; returns the stream's own reference once its last
  // operation has completed after the end, for the queue to drop. An
  // exception from handling it ends the stream (handle_failed).
  std::shared_ptr<PeerStream> on_event_guarded(int op, bool ok);
  void handle(Op op, bool ok);
  void handle_failed(Op op, const char* what);
  void on_read(bool ok);
  void read_failed(const grpc::Status& why);
  // Ends the stream with `why` (a reply that breaks the protocol).
  void fail(const grpc::Status& why);
  // Marks a read as posted, unless one is or reading has failed; the caller
  // then posts it (it may do so after releasing mu_).
  bool claim_read() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts the write of `frame`; write_in_flight_ was set for it.
  void write(const grpc::ByteBuffer& frame, bool more, void* tag);
  void maybe_finish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Half-closes the stream (at once, or once the write in flight ends) and
  // starts reading for its end; false if close() was called already, or
  // writes had ended otherwise (the stream broke): no end to wait for.
  bool half_close_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (mu_ held; released meanwhile) until cond() or `deadline`,
  // reading the queue itself whenever no other thread does.
  bool wait_reading(const std::function<bool()>& cond, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const OnFrame on_frame_;
  const OnClose on_close_;
  const int64_t max_message_bytes_;
  const bool accept_lent_tensors_;
  ClientQueue* const client_queue_;
  grpc::ClientContext ctx_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> call_;
  ClientQueue::Tag tags_[kNumOps];
  // Used only by the thread handling the read's completion.
  grpc::ByteBuffer read_buffer_;
  grpc::Status finish_status_;

  mutable absl::Mutex mu_;
  // State below is protected by mu_.
  std::shared_ptr<PeerStream> self_ ABSL_GUARDED_BY(mu_);  // while operations are posted
  int ops_pending_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);  // waiting to be written
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool writes_closed_ ABSL_GUARDED_BY(mu_) = false;  // no new writes start
  bool half_close_ ABSL_GUARDED_BY(mu_) = false;     // WritesDone once the queue drains
  bool read_pending_ ABSL_GUARDED_BY(mu_) = false;  // a Read is posted
  bool read_failed_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status read_status_ ABSL_GUARDED_BY(mu_);    // why reading stopped, if not the peer
  bool finish_started_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;       // the stream has ended
  bool closing_ ABSL_GUARDED_BY(mu_) = false;        // close() was called
  // A half-close was asked for (begin_close, or a graceful close), and
  // until when a graceful close waits for the peer's end.
  bool half_closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time close_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool connected_ ABSL_GUARDED_BY(mu_) = false;      // a reply has come (the channel was up)
  int64_t expecting_ ABSL_GUARDED_BY(mu_) = 0;       // replies not yet read
};

// Channel arguments tuned for large tensors on fast links, with `options`'
// keepalive; gRPC refuses received messages over its max_message_bytes.
grpc::ChannelArguments channel_arguments(const PeerOptions& options);


}  // namespace ddprpc::rpc::internal
