// gRPC transport of the RPC agent: one bidirectional stream per (caller,
// callee) pair carries serialized frames (see codec.h) both ways.
//
// - TransportServer: accepts streams; each request frame is handed to the
//   agent with a Responder that sends exactly one reply on the same stream.
//   Both ends use gRPC's asynchronous API, each queue read by one thread at
//   a time, so that a message wakes one thread.
// - PeerStream: the caller's side of a stream; replies go to a callback,
//   run by a waiting caller or the stream's background thread.
#pragma once

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
#include "rpc/internal/codec.h"

namespace ddprpc::rpc::internal {

class ServerStream;

// Sends the single reply to one request. Dropping it unsent counts the
// request as answered (e.g. one-way notices).
class Responder {
 public:
  explicit Responder(std::shared_ptr<ServerStream> stream);
  ~Responder();
  Responder(const Responder&) = delete;
  Responder& operator=(const Responder&) = delete;
  void send(grpc::ByteBuffer reply);
  // True once send() was called (from any thread).
  bool answered() const;

 private:
  std::shared_ptr<ServerStream> stream_;
  std::atomic<bool> answered_{false};
};

class TransportServer {
 public:
  using OnRequest = std::function<void(std::shared_ptr<Responder>, Frame)>;
  // Listens on host:0. Each request is passed either to `run_inline`, which
  // serves it on the calling (polling) thread, or to `offload`, which must
  // hand it to another thread (when the caller has more requests in flight).
  // Frames that fail to parse end their stream with INVALID_ARGUMENT.
  // Throws RpcError if it cannot listen.
  static std::unique_ptr<TransportServer> start(const std::string& host, OnRequest run_inline,
                                                OnRequest offload);
  ~TransportServer();
  int port() const { return port_; }
  // Ends all streams. Those whose callers are still connected get at most
  // `grace` to answer what they have read; replies due on streams their
  // callers have closed are dropped.
  void shutdown(absl::Duration grace);

  class Service;

 private:
  TransportServer() = default;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// The caller's end of a stream to one peer, on gRPC's asynchronous API.
// One thread at a time reads its completion queue (replies and write
// completions): a caller waiting for its own reply (drive()), so that the
// reply needs no thread hop, or else the stream's background thread, which
// reads while replies or writes are outstanding and no caller does.
class PeerStream {
 public:
  using OnFrame = std::function<void(Frame)>;
  // Called once when the stream ends, with why (OK after close()).
  using OnClose = std::function<void(const grpc::Status&)>;

  PeerStream(const std::string& address, OnFrame on_frame, OnClose on_close);
  ~PeerStream();

  // Queues a frame; false when the stream is closed or broken.
  // `expects_reply`: the peer answers it with one frame. `caller_drives`:
  // the sender drive()s for that reply at once, so the background thread
  // is not woken for it; every such send must be followed by one drive()
  // with `reserved` or by one unreserve().
  bool send(grpc::ByteBuffer frame, bool expects_reply, bool caller_drives);
  // Reads the stream on this thread, running on_frame for what arrives,
  // until done() or `deadline`; returns at once when another thread reads.
  void drive(const std::function<bool()>& done, absl::Time deadline, bool reserved);
  // Gives back a send's caller_drives reservation without driving.
  void unreserve();
  bool broken() const;
  // graceful: half-close and wait (at most 5 s) for the peer to end the
  // stream; otherwise cancel at once. Joins the background thread.
  void close(bool graceful);

 private:
  enum Op { kStart, kRead, kWrite, kWritesDone, kFinish, kNumOps };
  void* tag(Op op) { return &tags_[op]; }
  // Runs completion-queue events until done() or `deadline` (or the queue
  // is drained). The caller holds the reading role (driving_).
  void run_events(const std::function<bool()>& done, absl::Time deadline);
  void handle(Op op, bool ok);
  void read_failed(const grpc::Status& why);
  // Marks a read as posted, unless one is or reading has failed; the caller
  // then posts it (it may do so after releasing mu_).
  bool claim_read() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts the write of `frame`; write_in_flight_ was set for it.
  void write(const grpc::ByteBuffer& frame, bool more);
  void maybe_finish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool has_work() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void background_loop();

  const OnFrame on_frame_;
  const OnClose on_close_;
  grpc::ClientContext ctx_;
  std::shared_ptr<grpc::Channel> channel_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> call_;
  char tags_[kNumOps] = {};
  // Used only by the thread holding the reading role.
  grpc::ByteBuffer read_buffer_;
  grpc::Status finish_status_;

  mutable absl::Mutex mu_;
  // State below is protected by mu_.
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);  // waiting to be written
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool writes_closed_ ABSL_GUARDED_BY(mu_) = false;  // no new writes start
  bool half_close_ ABSL_GUARDED_BY(mu_) = false;     // WritesDone once the queue drains
  bool read_pending_ ABSL_GUARDED_BY(mu_) = false;  // a Read is posted
  bool read_failed_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status read_status_ ABSL_GUARDED_BY(mu_);    // why reading stopped, if not the peer
  bool finish_started_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;       // the stream has ended
  bool drained_ ABSL_GUARDED_BY(mu_) = false;        // the queue returned SHUTDOWN
  bool closing_ ABSL_GUARDED_BY(mu_) = false;        // close() was called
  int64_t expecting_ ABSL_GUARDED_BY(mu_) = 0;       // replies not yet read
  int reserved_ ABSL_GUARDED_BY(mu_) = 0;            // callers about to drive()
  bool driving_ ABSL_GUARDED_BY(mu_) = false;        // a thread holds the reading role
  std::thread background_;
};

// Channel arguments tuned for large tensors on fast links.
grpc::ChannelArguments channel_arguments();

}  // namespace ddprpc::rpc::internal
