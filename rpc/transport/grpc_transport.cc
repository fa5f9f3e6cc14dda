#include "rpc/transport/grpc_transport.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/resource_quota.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "rpc/core/errors.h"
#include "rpc/core/internal/auth.h"
#include "rpc/core/internal/fault.h"
#include "rpc/core/internal/thread_policy.h"
#include "rpc/transport/internal/caller_table.h"
#include "rpc/transport/internal/frame_capture.h"
#include "rpc/transport/internal/reading_role.h"
#include "rpc/transport/internal/spin_poll.h"
#include "rpc/transport/spin_budget.h"

namespace ddprpc::rpc::internal {
namespace {

// How long a thread reading a completion queue may look for its next event
// before it sleeps (SpinPoll): the transport's max_spin, on a machine where
// another thread can run meanwhile.
int64_t queue_spin_ns(const transport::TransportOptions& options) {
  return transport::usable_cpus() >= 2 ? transport::spin_ns(options.max_spin) : 0;
}

// The next event of `cq` as CompletionQueue::AsyncNext with `deadline`,
// after looking for one without sleeping for up to this thread's spin
// allowance under `spin_ns`.
template <typename Queue, typename Deadline>
grpc::CompletionQueue::NextStatus next_event(Queue* cq, int64_t spin_ns, void** tag, bool* ok,
                                             const Deadline& deadline) {
  if (spin_ns <= 0) return cq->AsyncNext(tag, ok, deadline);
  transport::SpinPoll& spin = transport::SpinPoll::this_thread(spin_ns);
  grpc::CompletionQueue::NextStatus status = grpc::CompletionQueue::TIMEOUT;
  if (spin.spin([&] {
        status = cq->AsyncNext(tag, ok, gpr_time_0(GPR_CLOCK_MONOTONIC));
        return status != grpc::CompletionQueue::TIMEOUT;
      })) {
    return status;
  }
  status = cq->AsyncNext(tag, ok, deadline);
  spin.slept();
  return status;
}

// The one method of the transport: a bidirectional stream of raw frames.
// Frames bypass protobuf (see codec.h), so the method is declared by hand
// with grpc::ByteBuffer messages instead of generated from a .proto.
constexpr char kStreamMethod[] = "/ddprpc.Transport/Stream";

int millis(absl::Duration d) {
  return static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 1, INT_MAX));
}

}  // namespace

// gRPC's smallest read buffer (one slice), used where its tcp_read_chunks
// experiment is off (kLowLatencyGrpcEnvironment): a frame that straddles two
// slices makes the reader announce window for the rest at once, a
// WINDOW_UPDATE written on its own before the frame reaches us. Frames on
// gRPC carry tensors below the bulk path's 256 KiB; with 256 KiB slices
// most of them sit in one, and the update goes out with the reply.
constexpr int kMinReadChunk = 256 << 10;

namespace {
// gRPC's message size limits are ints.
int grpc_message_limit(int64_t max_message_bytes) {
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(max_message_bytes, 0), INT_MAX));
}
}  // namespace

grpc::ChannelArguments channel_arguments(const PeerOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(grpc_message_limit(options.max_message_bytes));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, millis(options.keepalive_interval));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, millis(options.keepalive_timeout));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Pings keep going on a stream that sends nothing (the default stops
  // after 2 and keepalive silently ends).
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args.SetMaxSendMessageSize(-1);  // the agent checks what it sends
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 << 20);
  args.SetInt(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 16 << 20);
  // No per-call filters we do not use (deadlines and message sizes are the
  // agent's): rpc_pingpong 16 B p50 118 vs 155 us, pipelined calls +30%.
  args.SetInt(GRPC_ARG_MINIMAL_STACK, 1);
  // See kMinReadChunk.
  args.SetInt(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, kMinReadChunk);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return args;
}

// ------------------------------------------------------------- server side

// One accepted stream. The gRPC call (context + reader-writer) lives until
// the stream has finished and no operation of it is pending; Responders may
// keep this object longer, and what they send after the end is dropped.
class ServerStream {
 public:
  enum Op { kAccept, kRead, kWrite, kFinish, kNumOps };
  struct Tag {
    ServerStream* stream;
    Op op;
  };

  explicit ServerStream(const ServerLimits& limits)
      : max_pending_requests_(limits.max_pending_requests),
        max_pending_request_bytes_(limits.max_pending_request_bytes),
        max_pending_reply_bytes_(limits.max_pending_reply_bytes),
        call_(std::make_unique<Call>()) {
    for (int i = 0; i < kNumOps; ++i) tags_[i] = Tag{this, static_cast<Op>(i)};
  }

  void* tag(Op op) { return &tags_[op]; }
  grpc::GenericServerContext* context() { return &call_->ctx; }
  grpc::GenericServerAsyncReaderWriter* rw() { return &call_->rw; }

  // Set once when the stream is accepted, before its first read.
  void set_identity(int caller, std::string address) {
    caller_ = caller;
    address_ = std::move(address);
  }
  int caller() const { return caller_; }
  const std::string& address() const { return address_; }

  // Posts a read unless one is pending, reading has ended, or the stream
  // holds its limit of unanswered requests or unread replies (reading then
  // resumes as they drain).
  void read_next() {
    {
      absl::MutexLock lock(&mu_);
      if (closed_ || read_posted_ || read_ended_ || finish_started_) return;
      if (at_limit()) {
        throttled_ = true;
        return;
      }
      read_posted_ = true;
      ++ops_pending_;
      ++posting_;
    }
    call_->rw.Read(&read_buffer_, tag(kRead));
    posted();
  }

  // A completed read: the frame in `buffer`, or false once reading ended.
  bool take_read(bool ok, grpc::ByteBuffer* buffer) {
    if (ok) *buffer = std::move(read_buffer_);
    read_buffer_.Clear();
    absl::MutexLock lock(&mu_);
    read_posted_ = false;
    --ops_pending_;
    if (!ok) read_ended_ = true;
    return ok;
  }

  // Ends reading with `status` sent to the caller (e.g. a malformed frame);
  // requests still running are not waited for, their replies dropped.
  void fail(const grpc::Status& status) {
    bool cancel;
    {
      absl::MutexLock lock(&mu_);
      read_ended_ = true;
      aborted_ = true;
      if (status_.ok()) status_ = status;
      // A write the caller does not read would hold the stream open.
      cancel = write_in_flight_ && !closed_ && !finish_started_;
      if (cancel) ++posting_;  // the call is not released meanwhile
      queue_.clear();
      queued_bytes_ = 0;
    }
    if (cancel) {
      call_->ctx.TryCancel();
      posted();
    }
  }

  // A request of `bytes` read, until its end_request.
  void begin_request(int64_t bytes) {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
    request_bytes_ += bytes;
  }
  void end_request(int64_t bytes) {
    bool resume;
    {
      absl::MutexLock lock(&mu_);
      --in_flight_;
      request_bytes_ -= bytes;
      resume = take_throttle();
      if (in_flight_ > 0 && !resume) return;
      if (in_flight_ == 0) {
        resume = resume || read_deferred_;
        read_deferred_ = false;
      }
    }
    // After the reply's write: the read's WINDOW_UPDATE follows it.
    if (resume) read_next();
    // The last answer of a stream whose reading has ended finishes it (its
    // completion then lets the service forget the stream).
    advance(/*stopping=*/false);
  }

  // After a request ran inline: true if its reply is still due
  // (`reply_due`: async execution) and it is the stream's only request. The
  // next read then waits for that reply, so that its WINDOW_UPDATE does not
  // wake the caller while it waits, or for resume_read(). Otherwise reads on
  // at once.
  bool defer_read(bool reply_due) {
    {
      absl::MutexLock lock(&mu_);
      if (reply_due && in_flight_ == 1 && !read_posted_ && !read_ended_ && !closed_ &&
          !finish_started_) {
        read_deferred_ = true;
        return true;
      }
    }
    read_next();
    return false;
  }

  // Posts a deferred read now; false if none was deferred.
  bool resume_read() {
    {
      absl::MutexLock lock(&mu_);
      if (!read_deferred_) return false;
      read_deferred_ = false;
    }
    read_next();
    return true;
  }

  void send(grpc::ByteBuffer frame) {
    {
      absl::MutexLock lock(&mu_);
      if (closed_ || finish_started_ || write_failed_ || aborted_) return;  // the stream has ended
      if (write_in_flight_) {
        queued_bytes_ += static_cast<int64_t>(frame.Length());
        queue_.push_back(std::move(frame));
        return;
      }
      write_in_flight_ = true;
      ++ops_pending_;
      ++posting_;
    }
    call_->rw.Write(frame, tag(kWrite));  // gRPC keeps its own reference
    posted();
  }

  void write_done(bool ok) {
    grpc::ByteBuffer next;
    grpc::WriteOptions options;
    bool resume = false;
    {
      absl::MutexLock lock(&mu_);
      --ops_pending_;
      write_in_flight_ = false;
      if (!ok) {
        write_failed_ = true;
        queue_.clear();
        queued_bytes_ = 0;
        return;
      }
      if (queue_.empty() || closed_) return;
      next = std::move(queue_.front());
      queue_.pop_front();
      queued_bytes_ -= static_cast<int64_t>(next.Length());
      resume = take_throttle();
      // Frames queued behind this one follow at once: let gRPC coalesce them.
      if (!queue_.empty()) options.set_buffer_hint();
      write_in_flight_ = true;
      ++ops_pending_;
      ++posting_;
    }
    call_->rw.Write(next, options, tag(kWrite));
    posted();
    if (resume) read_next();
  }

  // Starts Finish once reading has ended and every request is answered (or
  // the server is stopping); true once the stream is over and its call can
  // be released.
  bool advance(bool stopping) {
    bool finish_now = false;
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return ops_pending_ == 0;
      if (!closed_ && !finish_started_ && read_ended_ && !read_posted_ && !write_in_flight_ &&
          (queue_.empty() || write_failed_) &&
          (in_flight_ == 0 || stopping || write_failed_ || aborted_)) {
        finish_started_ = true;
        finish_now = true;
        status = status_;
        ++ops_pending_;
        ++posting_;
      }
    }
    if (finish_now) {
      call_->rw.Finish(status, tag(kFinish));
      posted();
    }
    return false;
  }

  void finish_done() {
    absl::MutexLock lock(&mu_);
    --ops_pending_;
    finished_ = true;
    queue_.clear();
  }

  void accept_done() {
    absl::MutexLock lock(&mu_);
    --ops_pending_;
  }
  void accept_posted() {
    absl::MutexLock lock(&mu_);
    ++ops_pending_;
  }

 private:
  void posted() {
    absl::MutexLock lock(&mu_);
    --posting_;
  }

  // Whether the stream holds one of its limits of unanswered requests, their
  // bytes, or unread replies: reading waits.
  bool at_limit() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return in_flight_ >= max_pending_requests_ || request_bytes_ > max_pending_request_bytes_ ||
           queued_bytes_ > max_pending_reply_bytes_;
  }

  // True (clearing it) if reading paused at a limit and may resume now.
  bool take_throttle() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!throttled_ || at_limit()) return false;
    throttled_ = false;
    return true;
  }

 public:

  // Ends a stream whose worker opened a newer one (see bind_identity):
  // its pending read is cancelled, its replies dropped.
  void replace() {
    fail(grpc::Status(grpc::StatusCode::CANCELLED,
                      "replaced by a newer stream of the same worker"));
    {
      absl::MutexLock lock(&mu_);
      if (closed_ || finished_ || !call_) return;
      ++posting_;  // the call is not released meanwhile
    }
    call_->ctx.TryCancel();
    posted();
  }

  // No operation is posted from here on; waits for those being posted.
  void close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    auto quiet = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return posting_ == 0; };
    mu_.Await(absl::Condition(&quiet));
  }

  // Frees the gRPC call: the stream is over (advance() returned true) or
  // closed with the queue drained.
  void release() {
    close();
    call_.reset();
  }

 private:
  struct Call {
    grpc::GenericServerContext ctx;
    grpc::GenericServerAsyncReaderWriter rw{&ctx};
  };
  const int max_pending_requests_;
  const int64_t max_pending_request_bytes_;
  const int64_t max_pending_reply_bytes_;
  std::unique_ptr<Call> call_;
  Tag tags_[kNumOps];
  // Fixed when accepted (set_identity).
  int caller_ = -1;
  std::string address_;

  // Used only by the thread handling the read's completion.
  grpc::ByteBuffer read_buffer_;
  absl::Mutex mu_;
  // State below is protected by mu_.
  int ops_pending_ ABSL_GUARDED_BY(mu_) = 0;  // posted to gRPC, not completed
  bool read_posted_ ABSL_GUARDED_BY(mu_) = false;
  bool read_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool read_deferred_ ABSL_GUARDED_BY(mu_) = false;  // see defer_read()
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // requests not yet answered
  int64_t request_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // their bytes
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of queue_
  bool throttled_ ABSL_GUARDED_BY(mu_) = false;    // a read waits for a limit to clear
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;      // fail(): no more replies
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_started_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // the server's queue is shutting down
  int posting_ ABSL_GUARDED_BY(mu_) = 0;      // operations being posted outside mu_
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

GrpcResponder::GrpcResponder(std::shared_ptr<ServerStream> stream, int64_t bytes)
    : stream_(std::move(stream)), bytes_(bytes), caller_(stream_->caller()),
      address_(stream_->address()) {
  stream_->begin_request(bytes_);
}

bool GrpcResponder::answered() const { return answered_.load(std::memory_order_acquire); }

GrpcResponder::~GrpcResponder() {
  if (stream_) stream_->end_request(bytes_);
}

void GrpcResponder::send(Frame reply) {
  if (!stream_) return;
  stream_->send(serialize_frame(reply));
  answered_.store(true, std::memory_order_release);
  stream_->end_request(bytes_);
  stream_.reset();
}

// The server's completion queue is read by the holder of the reading role
// (internal/reading_role.h). It runs a request it reads itself (unless the
// caller said more of its requests are in flight: those go to `offload`),
// so that a request reaches its function with no thread hop, its reply goes
// out before the stream's next read is posted (whose WINDOW_UPDATE then
// follows the reply instead of waking the caller on its own), and only one
// thread in the process wakes for each segment that arrives. A request that
// runs longer than a watchdog tick or two (it blocks, or waits for a later
// request) loses the role: its stream's next read is posted and a waiting
// thread (started if none) takes over the queue.
class TransportServer::Service {
 public:
  Service(const ServerLimits& limits, const Security& security, CheckRequest check,
          OnRequest run_inline, OnRequest offload, const transport::TransportOptions& options)
      : limits_(limits),
        options_(options),
        spin_ns_(queue_spin_ns(options)),
        auth_(security.authenticated() ? std::make_unique<AuthChecker>(security.token) : nullptr),
        check_(std::move(check)),
        run_inline_(std::move(run_inline)),
        offload_(std::move(offload)),
        callers_(limits.world_size, limits.max_streams_per_worker),
        role_(&mu_, {"rpc transport", options.batch_scheduling, /*max_idle=*/-1},
              [this](int64_t me) { poll(me); }),
        watchdog_(&mu_, kWatchdogTick, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return look();
        }) {}

  ~Service() { stop_threads(); }

  grpc::AsyncGenericService* generic() { return &generic_; }

  // Throws RpcError when no polling thread can be started.
  void start(std::unique_ptr<grpc::ServerCompletionQueue> cq) {
    cq_ = std::move(cq);
    accept_next();
    {
      absl::MutexLock lock(&mu_);
      for (int i = 0; i < 2; ++i) role_.add_thread();
      if (role_.threads() == 0) {
        throw RpcError(ErrorCode::kInternal, "rpc transport: cannot start a polling thread");
      }
    }
    watchdog_.start(options_.batch_scheduling);
  }

  void stop() {
    std::vector<std::shared_ptr<ServerStream>> streams;
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      for (auto& [ptr, s] : streams_) streams.push_back(s);
    }
    // Streams still waiting for their requests' replies finish now.
    for (auto& s : streams) {
      s->resume_read();
      settle(s.get());
    }
  }

  // After the server has shut down: drains the queue and joins the threads.
  void stop_threads() {
    if (!cq_) return;
    std::vector<std::shared_ptr<ServerStream>> streams;
    {
      absl::MutexLock lock(&mu_);
      if (cq_shutdown_) return;
      cq_shutdown_ = true;
      for (auto& [ptr, s] : streams_) streams.push_back(s);
    }
    // A queue that is shut down takes no new operations.
    for (auto& s : streams) s->close();
    cq_->Shutdown();
    bool no_threads;
    {
      absl::MutexLock lock(&mu_);
      no_threads = role_.threads() == 0;
    }
    if (no_threads) {  // start() could start none: drain here
      void* tag;
      bool ok;
      while (cq_->Next(&tag, &ok)) {
      }
      absl::MutexLock lock(&mu_);
      drained_ = true;
    }
    {
      // The watchdog keeps handing the role on until the queue is drained.
      absl::MutexLock lock(&mu_);
      auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return drained_; };
      mu_.Await(absl::Condition(&drained));
      role_.stop();
    }
    watchdog_.stop();
    role_.join();
    for (auto& s : streams) s->release();  // every operation has completed
    absl::MutexLock lock(&mu_);
    streams_.clear();
  }

 private:
  // How often the watchdog looks at the request run by the polling thread
  // (and at deferred reads). A request found running at handoff_ticks() + 1
  // ticks in a row (two for the default inline_handoff) loses the role.
  static constexpr absl::Duration kWatchdogTick = absl::Milliseconds(5);
  int64_t handoff_ticks() const {
    return std::max<int64_t>(1, limits_.inline_handoff / kWatchdogTick - 1);
  }
  // Threads blocked in long requests beyond this many stop requests from
  // running inline: the rest go to `offload`.
  static constexpr int kMaxThreads = 64;  // busy ones: not waiting for the role

  void accept_next() {
    auto s = std::make_shared<ServerStream>(limits_);
    // Under mu_: the queue is not shut down meanwhile.
    absl::MutexLock lock(&mu_);
    if (stopping_ || cq_shutdown_) return;
    streams_.emplace(s.get(), s);
    s->accept_posted();
    generic_.RequestCall(s->context(), s->rw(), cq_.get(), cq_.get(), s->tag(ServerStream::kAccept));
  }

  std::shared_ptr<ServerStream> find(ServerStream* s) {
    absl::MutexLock lock(&mu_);
    auto it = streams_.find(s);
    return it == streams_.end() ? nullptr : it->second;
  }

  // Finishes the stream when it can; forgets it once it is over.
  void settle(ServerStream* s) {
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      stopping = stopping_;
    }
    if (!s->advance(stopping)) return;
    forget(s);
  }

  // Drops a stream that is over and frees its call.
  void forget(ServerStream* s) {
    std::shared_ptr<ServerStream> keep;
    absl::MutexLock lock(&mu_);
    auto it = streams_.find(s);
    if (it == streams_.end()) return;
    keep = std::move(it->second);
    streams_.erase(it);
    callers_.release(s->caller(), keep);
    s->release();
  }

  // Reads the queue while thread `me` holds the reading role: until the
  // queue is drained, or the watchdog took the role from a request `me`
  // ran.
  void poll(int64_t me) {
    while (true) {
      void* got = nullptr;
      bool ok = false;
      if (next_event(cq_.get(), spin_ns_, &got, &ok, gpr_inf_future(GPR_CLOCK_MONOTONIC)) !=
          grpc::CompletionQueue::GOT_EVENT) {
        absl::MutexLock lock(&mu_);
        drained_ = true;
        role_.stop();
        return;
      }
      const auto* tag = static_cast<ServerStream::Tag*>(got);
      // Held while handling: stop() may forget a finished stream meanwhile.
      std::shared_ptr<ServerStream> stream = find(tag->stream);
      if (stream && !handle_guarded(stream, tag->op, ok, me)) return;
    }
  }

  // handle(), with whatever it throws ending only the stream at hand.
  bool handle_guarded(const std::shared_ptr<ServerStream>& stream, ServerStream::Op op, bool ok,
                      int64_t me) {
    try {
      return handle(stream, op, ok, me);
    } catch (const std::exception& e) {
      reject(stream.get(), grpc::Status(grpc::StatusCode::INTERNAL,
                                        absl::StrCat("rpc transport: ", e.what())));
    } catch (...) {
      reject(stream.get(), grpc::Status(grpc::StatusCode::INTERNAL, "rpc transport: unknown error"));
    }
    return true;
  }

  // Handles one completion; false when thread `me` lost the reading role.
  bool handle(const std::shared_ptr<ServerStream>& stream, ServerStream::Op op, bool ok,
              int64_t me) {
    ServerStream* s = stream.get();
    switch (op) {
      case ServerStream::kAccept: {
        s->accept_done();
        if (!ok) {  // the server is shutting down
          settle_unaccepted(s);
          return true;
        }
        accept_next();
        grpc::Status bound = bind_identity(stream);
        if (!bound.ok()) {
          // Strangers may open streams as fast as they like: their
          // refusals are logged one in 100.
          LOG_EVERY_N(WARNING, 100) << "rpc transport: refusing a stream from "
                                    << s->context()->peer() << ": " << bound.error_message();
          s->fail(bound);
          settle(s);
          return true;
        }
        s->read_next();
        settle(s);
        return true;
      }
      case ServerStream::kRead:
        return on_read(stream, ok, me);
      case ServerStream::kWrite:
        s->write_done(ok);
        settle(s);
        return true;
      case ServerStream::kFinish:
        s->finish_done();
        settle(s);
        return true;
      case ServerStream::kNumOps:
        break;
    }
    return true;
  }

  void settle_unaccepted(ServerStream* s) {
    s->fail(grpc::Status::CANCELLED);
    forget(s);
  }

  // The worker a new stream belongs to, from its initial metadata; an
  // error status if it names none or an unknown one, or fails the job's
  // proof (the stream is then counted for nobody). At the worker's limit
  // of streams, its oldest gives way (CallerTable).
  grpc::Status bind_identity(const std::shared_ptr<ServerStream>& stream) {
    ServerStream* s = stream.get();
    const std::string address = s->context()->peer();
    s->set_identity(-1, address);
    if (s->context()->method() != kStreamMethod) {
      return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "unknown method");
    }
    const auto& metadata = s->context()->client_metadata();
    auto it = metadata.find(kWorkerMetadataKey);
    int id = -1;
    if (it == metadata.end() ||
        !absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &id) ||
        id < 0 || id >= limits_.world_size) {
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          absl::StrCat("a stream must name a worker of this job in its '",
                                       kWorkerMetadataKey, "' metadata"));
    }
    if (auth_) {
      grpc::Status proven = auth_->check(metadata, {"rpc", "grpc", id, limits_.self});
      if (!proven.ok()) return proven;
    }
    std::shared_ptr<ServerStream> replaced;
    {
      absl::MutexLock lock(&mu_);
      // A stream that shutdown already let go takes no slot (it would
      // never be released).
      if (streams_.find(s) == streams_.end()) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
      }
      s->set_identity(id, address);
      replaced = callers_.admit(id, stream);
    }
    if (replaced) {
      LOG(WARNING) << "rpc transport: a newer stream of worker " << id << " replaces the one from "
                   << replaced->address();
      replaced->replace();
    }
    return grpc::Status::OK;
  }

  // Ends a stream that broke a rule, and says so once.
  void reject(ServerStream* s, const grpc::Status& status) {
    LOG(WARNING) << "rpc transport: ending the stream from " << s->context()->peer()
                 << (s->caller() >= 0 ? absl::StrCat(" (worker ", s->caller(), ")") : "")
                 << ": " << status.error_message();
    s->fail(status);
    settle(s);
  }

  bool on_read(const std::shared_ptr<ServerStream>& self, bool ok, int64_t me) {
    ServerStream* s = self.get();
    grpc::ByteBuffer buffer;
    if (!s->take_read(ok, &buffer)) {  // the caller closed the stream, or it broke
      settle(s);
      return true;
    }
    Frame frame;
    grpc::Status valid = check_request(s, buffer, &frame);
    if (!valid.ok()) {
      reject(s, valid);
      return true;
    }
    std::shared_ptr<transport::Responder> responder =
        std::make_shared<GrpcResponder>(self, static_cast<int64_t>(buffer.Length()));
    uint64_t seq = 0;
    {
      absl::MutexLock lock(&mu_);
      // The caller has more requests coming: keep reading while this runs.
      if (!frame.more_in_flight && role_.busy_threads() < kMaxThreads) {
        seq = ++inline_seq_;
        inline_active_ = true;
        inline_stream_ = self;
      }
    }
    if (seq == 0) {
      s->read_next();
      try {
        offload_(std::move(responder), std::move(frame));
      } catch (const std::exception& e) {
        reject(s, grpc::Status(grpc::StatusCode::INTERNAL,
                               absl::StrCat("the request could not be queued: ", e.what())));
      }
      return true;
    }
    watchdog_.wake();
    const std::weak_ptr<transport::Responder> mine = responder;
    try {
      run_inline_(std::move(responder), std::move(frame));
    } catch (const std::exception& e) {
      reject(s, grpc::Status(grpc::StatusCode::INTERNAL,
                             absl::StrCat("serving a request failed: ", e.what())));
    }
    bool kept;
    {
      absl::MutexLock lock(&mu_);
      // Unless the watchdog took the role (and the run) meanwhile.
      kept = role_.held_by(me);
      if (kept) {
        inline_active_ = false;
        inline_stream_.reset();
      }
    }
    // After the reply, if it is ready; a no-op if the watchdog posted it.
    const std::shared_ptr<transport::Responder> still_held = mine.lock();
    if (s->defer_read(still_held && !still_held->answered())) {
      absl::MutexLock lock(&mu_);
      deferred_.push_back({self, watchdog_ticks_});
      watchdog_.wake_locked();
    }
    return kept;
  }

  // Parses a request frame and checks that its stream may send it.
  grpc::Status check_request(ServerStream* s, const grpc::ByteBuffer& buffer, Frame* frame) {
    fault_point("transport.server_read");
    const uint64_t length = buffer.Length();
    if (length > static_cast<uint64_t>(limits_.max_message_bytes)) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("frame of ", length, " bytes exceeds max_message_bytes (",
                                       limits_.max_message_bytes, ")"));
    }
    if (!options_.capture_frames_dir.empty()) {
      capture_frame(options_.capture_frames_dir, "request", buffer);
    }
    absl::Status parsed =
        parse_frame(buffer, frame, ParseOptions{limits_.accept_lent_tensors});
    if (!parsed.ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("malformed frame: ", parsed.message()));
    }
    if (check_) {
      const absl::Status checked = check_(s->caller(), *frame);
      if (!checked.ok()) {
        // absl's status codes are gRPC's canonical codes.
        return grpc::Status(static_cast<grpc::StatusCode>(checked.code()),
                            std::string(checked.message()));
      }
    }
    return grpc::Status::OK;
  }

  // The watchdog's look, each tick while a request runs inline or a read
  // is deferred; it parks otherwise.
  absl::Duration look() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ++watchdog_ticks_;
    // A read deferred for a reply that has not come for a tick or two is
    // posted: that reply may wait for the caller's next request.
    std::vector<std::shared_ptr<ServerStream>> resume;
    for (auto it = deferred_.begin(); it != deferred_.end();) {
      if (watchdog_ticks_ - it->since >= 2) {
        resume.push_back(std::move(it->stream));
        it = deferred_.erase(it);
      } else {
        ++it;
      }
    }
    if (!resume.empty()) {
      mu_.Unlock();
      for (auto& stream : resume) stream->resume_read();
      resume.clear();
      mu_.Lock();
    }
    if (!inline_active_) {
      return deferred_.empty() ? absl::InfiniteDuration() : kWatchdogTick;
    }
    inline_ticks_ = inline_seq_ == watchdog_seq_ ? inline_ticks_ + 1 : 0;
    if (inline_ticks_ >= handoff_ticks()) {  // the same request for that many ticks
      inline_ticks_ = 0;
      inline_active_ = false;
      std::shared_ptr<ServerStream> stream = std::move(inline_stream_);
      role_.hand_off();
      mu_.Unlock();
      stream->read_next();
      stream.reset();
      mu_.Lock();
    }
    watchdog_seq_ = inline_seq_;
    return kWatchdogTick;
  }

  const ServerLimits limits_;
  const transport::TransportOptions options_;
  const int64_t spin_ns_;  // queue_spin_ns(options_)
  const std::unique_ptr<AuthChecker> auth_;  // null: streams are not authenticated
  const CheckRequest check_;
  const OnRequest run_inline_;
  const OnRequest offload_;
  grpc::AsyncGenericService generic_;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  absl::Mutex mu_;
  // State below is protected by mu_.
  absl::flat_hash_map<ServerStream*, std::shared_ptr<ServerStream>> streams_ ABSL_GUARDED_BY(mu_);
  // The accepted streams that proved their worker.
  CallerTable<std::shared_ptr<ServerStream>> callers_ ABSL_GUARDED_BY(mu_);
  bool inline_active_ ABSL_GUARDED_BY(mu_) = false;  // the role holder runs a request
  std::shared_ptr<ServerStream> inline_stream_ ABSL_GUARDED_BY(mu_);
  uint64_t inline_seq_ ABSL_GUARDED_BY(mu_) = 0;    // inline requests started
  uint64_t watchdog_seq_ ABSL_GUARDED_BY(mu_) = 0;  // inline_seq_ at the last tick
  int64_t inline_ticks_ ABSL_GUARDED_BY(mu_) = 0;   // ticks since watchdog_seq_ changed
  uint64_t watchdog_ticks_ ABSL_GUARDED_BY(mu_) = 0;
  struct Deferred {
    std::shared_ptr<ServerStream> stream;
    uint64_t since;  // watchdog_ticks_ when deferred
  };
  std::vector<Deferred> deferred_ ABSL_GUARDED_BY(mu_);  // streams with a deferred read
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;      // stop(): no new streams
  bool cq_shutdown_ ABSL_GUARDED_BY(mu_) = false;
  bool drained_ ABSL_GUARDED_BY(mu_) = false;       // the queue returned its end
  // Declared last: their threads use the state above.
  ReadingRole role_;
  RoleWatchdog watchdog_;
};

std::unique_ptr<TransportServer> TransportServer::start(const std::string& host,
                                                        const ServerLimits& limits,
                                                        const Security& security,
                                                        CheckRequest check, OnRequest run_inline,
                                                        OnRequest offload,
                                                        const transport::TransportOptions& options) {
  std::unique_ptr<TransportServer> s(new TransportServer());
  s->service_ = std::make_unique<Service>(limits, security, std::move(check),
                                          std::move(run_inline), std::move(offload), options);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(host, ":0"), server_credentials(security), &s->port_);
  // gRPC enforces this only without a minimal stack (and after receiving
  // the whole message); check_request() checks every frame, and the quota
  // bounds what is buffered before.
  builder.SetMaxReceiveMessageSize(grpc_message_limit(limits.max_message_bytes));
  builder.SetMaxSendMessageSize(INT_MAX);
  grpc::ResourceQuota quota("ddprpc-transport");
  quota.Resize(static_cast<size_t>(std::max<int64_t>(limits.max_buffered_bytes, 1 << 20)));
  builder.SetResourceQuota(quota);
  // One stream per connection is what callers open.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, limits.max_streams_per_worker);
  // Strangers: a connection finishes its TLS handshake within
  // handshake_timeout; a stream proves the token from its metadata before
  // anything it sends is read (bind_identity), and what gRPC buffers
  // meanwhile counts against the quota above. (The minimal stack has no
  // idle or age filter: a connection that opens no stream costs a
  // descriptor until its peer closes it or stops answering keepalives.)
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, millis(limits.handshake_timeout));
  // Liveness both ways: this end pings its callers, and takes their pings
  // (one per keepalive_interval) without calling them abusive.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, millis(limits.keepalive_interval));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, millis(limits.keepalive_timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             millis(limits.keepalive_interval / 4));
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 << 20);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 16 << 20);
  builder.AddChannelArgument(GRPC_ARG_MINIMAL_STACK, 1);
  builder.AddChannelArgument(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, kMinReadChunk);
  builder.RegisterAsyncGenericService(s->service_->generic());
  auto cq = builder.AddCompletionQueue();
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->port_ == 0) {
    cq->Shutdown();
    void* tag;
    bool ok;
    while (cq->Next(&tag, &ok)) {
    }
    throw RpcError(ErrorCode::kUnavailable,
                   absl::StrCat("rpc transport: cannot listen on ", host));
  }
  s->service_->start(std::move(cq));
  return s;
}

void TransportServer::shutdown(absl::Duration grace) {
  if (!server_) return;
  service_->stop();
  // Streams still open end with the server; calls not over by the deadline
  // are cancelled. The service's threads keep draining the queue meanwhile.
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  service_->stop_threads();
  server_.reset();
}

TransportServer::~TransportServer() { shutdown(absl::ZeroDuration()); }

// -------------------------------------------------------------- client side

ClientQueue::ClientQueue(transport::TransportOptions options)
    : options_(std::move(options)), spin_ns_(queue_spin_ns(options_)), background_([this] {
        apply_thread_policy(options_.batch_scheduling);
        background_loop();
      }) {}

ClientQueue::~ClientQueue() {
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
  }
  cq_.Shutdown();  // the background thread drains it
  background_.join();
}

void ClientQueue::will_post() {
  absl::MutexLock lock(&mu_);
  ++pending_;
}

void ClientQueue::reserve_reading() {
  absl::MutexLock lock(&mu_);
  ++reserved_;
}

void ClientQueue::release_reading() {
  absl::MutexLock lock(&mu_);
  if (reserved_ > 0) --reserved_;
}

void ClientQueue::interrupt() {
  absl::MutexLock lock(&mu_);
  if (reader_ == std::thread::id() || shutting_down_ || alarm_) return;
  // The reader looks at its condition before it waits again. The
  // background reader waits for nothing a completion elsewhere brings,
  // unless a caller waits for its role (that caller's condition is looked
  // at again when the alarm's event releases mu_).
  if (reader_ == std::this_thread::get_id()) return;
  if (reader_ == background_.get_id() && want_role_ == 0) return;
  ++pending_;  // the alarm's completion uncounts it
  alarm_ = std::make_unique<grpc::Alarm>();
  // A deadline already past: gRPC completes the alarm at once. gRPC's
  // timers count whole milliseconds, rounded up, so a deadline of "now"
  // fires at the next millisecond tick: that is kept for interrupts less
  // than a millisecond apart (a stream of replies from the same host),
  // which then wake the reader at most once a tick between them.
  const absl::Time now = absl::Now();
  const bool recent = now - last_interrupt_ < absl::Milliseconds(1);
  last_interrupt_ = now;
  alarm_->Set(&cq_, recent ? gpr_now(GPR_CLOCK_MONOTONIC) : gpr_inf_past(GPR_CLOCK_MONOTONIC),
              &alarm_tag_);
}

bool ClientQueue::read_if_free(const std::function<bool()>& done, absl::Time deadline) {
  const std::thread::id me = std::this_thread::get_id();
  bool nested = false;
  {
    absl::MutexLock lock(&mu_);
    if (reader_ == me) {
      nested = true;  // a callback this thread runs as the reader waits
    } else if (reader_ != std::thread::id() || drained_) {
      return false;
    } else {
      reader_ = me;
    }
  }
  run_events(done, deadline);
  if (nested) return true;  // the outer read lets the role go
  absl::MutexLock lock(&mu_);
  reader_ = std::thread::id();
  return true;
}

void ClientQueue::drive(const std::function<bool()>& done, absl::Time deadline) {
  while (!read_if_free(done, deadline)) {
    absl::MutexLock lock(&mu_);
    // done() is evaluated under mu_: the reader takes mu_ after each event.
    auto role_or_done = [this, &done]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return reader_ == std::thread::id() || drained_ || done();
    };
    ++want_role_;
    const bool woken = mu_.AwaitWithDeadline(absl::Condition(&role_or_done), deadline);
    --want_role_;
    if (!woken || drained_ || done()) return;
  }
}

void ClientQueue::run_events(const std::function<bool()>& done, absl::Time deadline) {
  // Slices bound how long a completion from elsewhere (a timeout, shutdown)
  // goes unnoticed by a waiting caller.
  constexpr absl::Duration kSlice = absl::Milliseconds(50);
  while (!done()) {
    void* got = nullptr;
    bool ok = false;
    const absl::Time until = std::min(deadline, absl::Now() + kSlice);
    switch (next_event(&cq_, spin_ns_, &got, &ok, absl::ToChronoTime(until))) {
      case grpc::CompletionQueue::SHUTDOWN: {
        absl::MutexLock lock(&mu_);
        drained_ = true;
        return;
      }
      case grpc::CompletionQueue::TIMEOUT:
        if (absl::Now() >= deadline) return;
        break;
      case grpc::CompletionQueue::GOT_EVENT: {
        if (got == &alarm_tag_) {  // interrupt(): look at done() again
          std::unique_ptr<grpc::Alarm> fired;
          absl::MutexLock lock(&mu_);
          fired = std::move(alarm_);
          --pending_;
          break;
        }
        const auto* tag = static_cast<const Tag*>(got);
        const int op = tag->op;
        // Dropped after the count: the stream may go with it.
        std::shared_ptr<PeerStream> ended = tag->stream->on_event_guarded(op, ok);
        if (op == PeerStream::kStart) break;  // not counted (see PeerStream::open)
        absl::MutexLock lock(&mu_);
        --pending_;
        break;
      }
    }
  }
}

void ClientQueue::background_loop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        // A caller waiting for the role (want_role_) gets it first.
        return drained_ || (reader_ == std::thread::id() && want_role_ == 0 &&
                            (shutting_down_ || (pending_ > 0 && reserved_ == 0)));
      };
      mu_.Await(absl::Condition(&ready));
      if (drained_) return;
      reader_ = std::this_thread::get_id();
    }
    // Reads until nothing is outstanding, or a caller reserves the queue or
    // waits for the role (that caller reads from here on).
    run_events(
        [this] {
          absl::MutexLock lock(&mu_);
          if (shutting_down_) return false;  // read until drained
          return pending_ == 0 || reserved_ > 0 || want_role_ > 0;
        },
        absl::InfiniteFuture());
    absl::MutexLock lock(&mu_);
    reader_ = std::thread::id();
  }
}

std::shared_ptr<PeerStream> PeerStream::open(const std::string& address,
                                             const PeerOptions& options, ClientQueue* queue,
                                             OnFrame on_frame, OnClose on_close) {
  std::shared_ptr<PeerStream> s(
      new PeerStream(address, options, queue, std::move(on_frame), std::move(on_close)));
  s->ctx_.AddMetadata(kWorkerMetadataKey, absl::StrCat(options.self));
  if (options.security.authenticated()) {
    s->ctx_.AddMetadata(kAuthMetadataKey, auth_proof(options.security.token,
                                                      {"rpc", "grpc", options.self, options.peer}));
  }
  grpc::GenericStub stub(s->channel_);
  s->call_ = stub.PrepareCall(&s->ctx_, kStreamMethod, queue->cq());
  {
    absl::MutexLock lock(&s->mu_);
    s->self_ = s;
  }
  // With initial metadata corked the start's tag never completes (the
  // metadata goes with the first write), so it is not counted.
  s->call_->StartCall(&s->tags_[kStart]);
  return s;
}

PeerStream::PeerStream(const std::string& address, const PeerOptions& options,
                       ClientQueue* queue, OnFrame on_frame, OnClose on_close)
    : on_frame_(std::move(on_frame)),
      on_close_(std::move(on_close)),
      max_message_bytes_(options.max_message_bytes),
      accept_lent_tensors_(options.accept_lent_tensors),
      client_queue_(queue),
      channel_(grpc::CreateCustomChannel(address, channel_credentials(options.security),
                                         channel_arguments(options))) {
  for (int i = 0; i < kNumOps; ++i) tags_[i] = ClientQueue::Tag{this, i};
  // Initial metadata goes out with the first frame, so opening never blocks.
  ctx_.set_initial_metadata_corked(true);
}

// Reached once the last operation has completed (or none was posted).
PeerStream::~PeerStream() = default;

void* PeerStream::post(Op op) {
  ++ops_pending_;
  client_queue_->will_post();
  return &tags_[op];
}

bool PeerStream::broken() const {
  absl::MutexLock lock(&mu_);
  // After a half-close, writes are closed on purpose; a write that failed
  // meanwhile shows as the read's failure, which follows it.
  return read_failed_ || (writes_closed_ && !closing_ && !half_closed_);
}

bool PeerStream::send(Frame message, const transport::SendOptions& options) {
  const bool expects_reply = options.expects_reply;
  message.more_in_flight = options.more_in_flight;
  grpc::ByteBuffer frame = serialize_frame(message);
  void* write_tag = nullptr;
  void* read_tag = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (writes_closed_ || closing_ || half_closed_) return false;
    if (expects_reply) ++expecting_;
    if (!write_in_flight_) {
      write_in_flight_ = true;  // this thread writes it, below
      write_tag = post(kWrite);
    } else {
      queue_.push_back(std::move(frame));
    }
    if (expecting_ > 0 && claim_read()) read_tag = post(kRead);
  }
  // Outside the lock: gRPC may write to the socket here. With
  // write_in_flight_ set, no other write, WritesDone or Finish starts
  // meanwhile; with read_pending_ set, no other read.
  if (write_tag) write(frame, /*more=*/false, write_tag);
  // After the write: the read's WINDOW_UPDATE follows the request at once
  // instead of waking the idle peer on its own.
  if (read_tag) call_->Read(&read_buffer_, read_tag);
  return true;
}

bool PeerStream::claim_read() {
  if (read_pending_ || read_failed_) return false;
  read_pending_ = true;
  return true;
}

void PeerStream::write(const grpc::ByteBuffer& frame, bool more, void* tag) {
  grpc::WriteOptions options;
  // Frames queued behind this one follow at once: let gRPC coalesce them.
  if (more) options.set_buffer_hint();
  call_->Write(frame, options, tag);  // gRPC keeps its own reference
}

std::shared_ptr<PeerStream> PeerStream::on_event_guarded(int op, bool ok) {
  if (op == kStart) return nullptr;
  try {
    handle(static_cast<Op>(op), ok);
  } catch (const std::exception& e) {
    handle_failed(static_cast<Op>(op), e.what());
  } catch (...) {
    handle_failed(static_cast<Op>(op), "unknown error");
  }
  absl::MutexLock lock(&mu_);
  --ops_pending_;
  if (finished_ && ops_pending_ == 0) return std::move(self_);
  return nullptr;
}

void PeerStream::handle_failed(Op op, const char* what) {
  if (op == kRead) {
    // on_read() threw before it posted the next read.
    absl::MutexLock lock(&mu_);
    read_pending_ = false;
  }
  fail(grpc::Status(grpc::StatusCode::INTERNAL, absl::StrCat("rpc transport: ", what)));
}

void PeerStream::handle(Op op, bool ok) {
  switch (op) {
    case kStart:
    case kWritesDone:
    case kNumOps:
      return;
    case kWrite: {
      grpc::ByteBuffer next;
      bool more = false;
      void* next_tag = nullptr;
      {
        absl::MutexLock lock(&mu_);
        write_in_flight_ = false;
        if (!ok) {
          writes_closed_ = true;  // the read side reports why
          queue_.clear();
        } else if (!queue_.empty() && !writes_closed_) {
          next = std::move(queue_.front());
          queue_.pop_front();
          more = !queue_.empty();
          write_in_flight_ = true;  // written below, outside the lock
          next_tag = post(kWrite);
        } else if (half_close_ && !writes_closed_) {
          writes_closed_ = true;
          call_->WritesDone(post(kWritesDone));
        }
        maybe_finish();  // once no write is in flight
      }
      if (next_tag) write(next, more, next_tag);
      return;
    }
    case kRead:
      on_read(ok);
      return;
    case kFinish: {
      grpc::Status status;
      {
        absl::MutexLock lock(&mu_);
        finished_ = true;  // writes closed and queue cleared when the read failed
        status = read_status_.ok() ? finish_status_ : read_status_;
      }
      transport::CloseReason reason;
      reason.ok = status.ok();
      reason.unreachable = status.error_code() == grpc::StatusCode::UNAVAILABLE;
      reason.message = status.error_message();
      try {
        on_close_(reason);
      } catch (const std::exception& e) {
        LOG(ERROR) << "rpc transport: a stream's close handler threw (ignored): " << e.what();
      }
      return;
    }
  }
}

void PeerStream::on_read(bool ok) {
  // read_pending_ stays set until read_buffer_ is parsed: a send that
  // posted the next read now would have it overwritten.
  if (!ok) {
    read_failed(grpc::Status::OK);
    return;
  }
  Frame frame;
  absl::Status parsed;
  const uint64_t length = read_buffer_.Length();
  if (length > static_cast<uint64_t>(max_message_bytes_)) {
    parsed = absl::ResourceExhaustedError(absl::StrCat(
        "reply of ", length, " bytes exceeds max_message_bytes (", max_message_bytes_, ")"));
  } else {
    fault_point("transport.client_read");
    if (!client_queue_->options_.capture_frames_dir.empty()) {
      capture_frame(client_queue_->options_.capture_frames_dir, "reply",
                                         read_buffer_);
    }
    parsed = parse_frame(read_buffer_, &frame, ParseOptions{accept_lent_tensors_});
  }
  read_buffer_.Clear();
  if (!parsed.ok()) {
    {
      absl::MutexLock lock(&mu_);
      read_pending_ = false;
    }
    fail(grpc::Status(grpc::StatusCode::DATA_LOSS,
                      absl::StrCat("malformed reply frame: ", parsed.message())));
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    read_pending_ = false;
    connected_ = true;
    if (expecting_ > 0) --expecting_;
    // Reading on only while replies are due (or the stream is closing and
    // its end must be seen): a read posted on an idle stream sends a
    // WINDOW_UPDATE that wakes the peer for nothing.
    if ((expecting_ > 0 || closing_ || half_closed_) && claim_read()) {
      call_->Read(&read_buffer_, post(kRead));
    }
  }
  // From here on the next read may be posted: what throws is handled here.
  absl::Status accepted;
  try {
    accepted = on_frame_(std::move(frame));
  } catch (const std::exception& e) {
    accepted = absl::InternalError(absl::StrCat("handling a reply failed: ", e.what()));
  } catch (...) {
    accepted = absl::InternalError("handling a reply failed: an exception of no known type");
  }
  if (!accepted.ok()) {
    fail(grpc::Status(grpc::StatusCode::DATA_LOSS, std::string(accepted.message())));
  }
}

void PeerStream::check_connection() {
  const grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/false);
  if (state == GRPC_CHANNEL_READY || state == GRPC_CHANNEL_CONNECTING) return;
  void* read_tag = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (!connected_ || closing_ || !claim_read()) return;
    read_tag = post(kRead);
  }
  call_->Read(&read_buffer_, read_tag);
}

void PeerStream::fail(const grpc::Status& why) {
  LOG(WARNING) << "rpc transport: ending a stream to " << ctx_.peer() << ": "
               << why.error_message();
  void* read_tag = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (read_status_.ok()) read_status_ = why;
    // The cancelled stream's end arrives as a failed read, which finishes it.
    if (claim_read()) read_tag = post(kRead);
  }
  ctx_.TryCancel();
  if (read_tag) call_->Read(&read_buffer_, read_tag);
}

void PeerStream::read_failed(const grpc::Status& why) {
  absl::MutexLock lock(&mu_);
  read_pending_ = false;
  read_failed_ = true;
  writes_closed_ = true;
  queue_.clear();
  if (read_status_.ok()) read_status_ = why;
  maybe_finish();
}

void PeerStream::maybe_finish() {
  // Finish once reading has stopped and no write is in flight.
  if (!read_failed_ || write_in_flight_ || finish_started_) return;
  finish_started_ = true;
  call_->Finish(&finish_status_, post(kFinish));
}

bool PeerStream::half_close_locked() {
  if (closing_) return false;
  if (half_closed_) return true;
  if (writes_closed_) return false;
  half_closed_ = true;
  close_deadline_ = absl::Now() + transport::kGracefulCloseWait;
  // The stream's end arrives as a failed read, which starts Finish.
  if (claim_read()) call_->Read(&read_buffer_, post(kRead));
  if (write_in_flight_) {
    half_close_ = true;
  } else {
    writes_closed_ = true;
    call_->WritesDone(post(kWritesDone));
  }
  return true;
}

void PeerStream::begin_close() {
  absl::MutexLock lock(&mu_);
  half_close_locked();
}

void PeerStream::close(bool graceful) {
  const std::function<bool()> over = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return finished_ && ops_pending_ == 0;
  };
  {
    absl::MutexLock lock(&mu_);
    if (closing_) return;
    const bool wait = graceful && half_close_locked();
    closing_ = true;
    // The stream's end (the peer's, or our cancel below) arrives as a failed
    // read, which starts Finish.
    if (claim_read()) call_->Read(&read_buffer_, post(kRead));
    if (wait) {
      // The peer ends the stream once it has answered everything it received.
      wait_reading([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return finished_; },
                   close_deadline_);
    }
    writes_closed_ = true;
  }
  ctx_.TryCancel();
  // Every completion of this stream has run once the queue's reader has
  // handled them.
  absl::MutexLock lock(&mu_);
  wait_reading(over, absl::InfiniteFuture());
}

bool PeerStream::wait_reading(const std::function<bool()>& cond, absl::Time deadline) {
  // Read on this thread whenever no other does: the background reader
  // stays off while a SyncCallScope is open anywhere in the process.
  constexpr absl::Duration kSlice = absl::Milliseconds(20);
  const std::function<bool()> cond_unlocked = [this, &cond] {
    absl::MutexLock lock(&mu_);
    return cond();
  };
  while (!cond()) {
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    const absl::Time until = std::min(deadline, now + kSlice);
    mu_.Unlock();
    const bool read = client_queue_->read_if_free(cond_unlocked, until);
    mu_.Lock();
    if (!read) mu_.AwaitWithDeadline(absl::Condition(&cond), until);
  }
  return true;
}

// ------------------------------------------------------------ the transport

namespace {

class GrpcTransport : public transport::Transport {
 public:
  explicit GrpcTransport(const transport::TransportOptions& options)
      : options_(options), queue_(std::make_unique<ClientQueue>(options)) {}

  std::unique_ptr<transport::Server> listen(const std::string& host, const ServerLimits& limits,
                                            const Security& security, CheckRequest check,
                                            OnRequest run_inline, OnRequest offload) override {
    return TransportServer::start(host, limits, security, std::move(check),
                                  std::move(run_inline), std::move(offload), options_);
  }

  std::shared_ptr<transport::Channel> connect(const std::string& address,
                                              const PeerOptions& options,
                                              transport::Channel::OnFrame on_frame,
                                              transport::Channel::OnClose on_close) override {
    return PeerStream::open(address, options, queue_.get(), std::move(on_frame),
                            std::move(on_close));
  }

  void reserve_reading() override { queue_->reserve_reading(); }
  void release_reading() override { queue_->release_reading(); }
  void interrupt_drive() override { queue_->interrupt(); }
  void drive(const std::function<bool()>& done, absl::Time deadline) override {
    queue_->drive(done, deadline);
  }

  bool probe(const std::string& address, const PeerOptions& options,
             absl::Time deadline) override {
    auto channel = grpc::CreateCustomChannel(address, channel_credentials(options.security),
                                             channel_arguments(options));
    return channel->WaitForConnected(absl::ToChronoTime(deadline));
  }

 private:
  const transport::TransportOptions options_;
  // Every stream opened through connect() must be closed before the
  // transport goes (the queue's destructor drains it).
  const std::unique_ptr<ClientQueue> queue_;
};

}  // namespace

std::shared_ptr<transport::Transport> make_grpc_transport(
    const transport::TransportOptions& options) {
  return std::make_shared<GrpcTransport>(options);
}

}  // namespace ddprpc::rpc::internal

namespace ddprpc::rpc::transport {
std::shared_ptr<Transport> make_default_transport(const TransportOptions& options) {
  return internal::make_grpc_transport(options);
}
}  // namespace ddprpc::rpc::transport
