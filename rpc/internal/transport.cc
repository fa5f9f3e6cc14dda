#include "rpc/internal/transport.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "rpc/errors.h"

namespace ddprpc::rpc::internal {
namespace {

// The one method of the transport: a bidirectional stream of raw frames.
// Frames bypass protobuf (see codec.h), so the method is declared by hand
// with grpc::ByteBuffer messages instead of generated from a .proto.
constexpr char kStreamMethod[] = "/ddprpc.Transport/Stream";

// gRPC's default epoll1 poller lets any blocked gRPC thread pick up a
// socket event and then wake the thread waiting for it: an extra thread hop
// per message, which costs ~40 us on small VMs. The "poll" engine lets the
// waiting thread poll for itself. Set before gRPC initializes; an explicit
// GRPC_POLL_STRATEGY in the environment wins.
const bool kPollStrategySet = [] {
  ::setenv("GRPC_POLL_STRATEGY", "poll", /*overwrite=*/0);
  return true;
}();

}  // namespace

constexpr int kMinReadChunk = 64 << 10;

grpc::ChannelArguments channel_arguments() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);  // the agent enforces its own limit
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 << 20);
  args.SetInt(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 16 << 20);
  // No per-call filters we do not use (deadlines and message sizes are the
  // agent's): rpc_pingpong 16 B p50 118 vs 155 us, pipelined calls +30%.
  args.SetInt(GRPC_ARG_MINIMAL_STACK, 1);
  // Reads of at least 64 KiB: a message read in pieces makes gRPC announce
  // window for the rest at once, a WINDOW_UPDATE that wakes the sender.
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

  ServerStream() : call_(std::make_unique<Call>()) {
    for (int i = 0; i < kNumOps; ++i) tags_[i] = Tag{this, static_cast<Op>(i)};
  }

  void* tag(Op op) { return &tags_[op]; }
  grpc::GenericServerContext* context() { return &call_->ctx; }
  grpc::GenericServerAsyncReaderWriter* rw() { return &call_->rw; }

  // Posts a read unless one is pending or reading has ended.
  void read_next() {
    {
      absl::MutexLock lock(&mu_);
      if (closed_ || read_posted_ || read_ended_ || finish_started_) return;
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

  // Ends reading with `status` sent to the caller (e.g. a malformed frame).
  void fail(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    read_ended_ = true;
    if (status_.ok()) status_ = status;
  }

  void begin_request() {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
  }
  void end_request() {
    bool resume;
    {
      absl::MutexLock lock(&mu_);
      --in_flight_;
      if (in_flight_ > 0) return;
      resume = read_deferred_;
      read_deferred_ = false;
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
      if (closed_ || finish_started_ || write_failed_) return;  // the stream has ended
      if (write_in_flight_) {
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
    {
      absl::MutexLock lock(&mu_);
      --ops_pending_;
      write_in_flight_ = false;
      if (!ok) {
        write_failed_ = true;
        queue_.clear();
        return;
      }
      if (queue_.empty() || closed_) return;
      next = std::move(queue_.front());
      queue_.pop_front();
      // Frames queued behind this one follow at once: let gRPC coalesce them.
      if (!queue_.empty()) options.set_buffer_hint();
      write_in_flight_ = true;
      ++ops_pending_;
      ++posting_;
    }
    call_->rw.Write(next, options, tag(kWrite));
    posted();
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
          (queue_.empty() || write_failed_) && (in_flight_ == 0 || stopping || write_failed_)) {
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

 public:

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
  std::unique_ptr<Call> call_;
  Tag tags_[kNumOps];
  // Used only by the thread handling the read's completion.
  grpc::ByteBuffer read_buffer_;
  absl::Mutex mu_;
  // State below is protected by mu_.
  int ops_pending_ ABSL_GUARDED_BY(mu_) = 0;  // posted to gRPC, not completed
  bool read_posted_ ABSL_GUARDED_BY(mu_) = false;
  bool read_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool read_deferred_ ABSL_GUARDED_BY(mu_) = false;  // see defer_read()
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // requests not yet answered
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_started_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // the server's queue is shutting down
  int posting_ ABSL_GUARDED_BY(mu_) = 0;      // operations being posted outside mu_
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

Responder::Responder(std::shared_ptr<ServerStream> stream) : stream_(std::move(stream)) {
  stream_->begin_request();
}

bool Responder::answered() const { return answered_.load(std::memory_order_acquire); }

Responder::~Responder() {
  if (stream_) stream_->end_request();
}

void Responder::send(grpc::ByteBuffer reply) {
  if (!stream_) return;
  stream_->send(std::move(reply));
  answered_.store(true, std::memory_order_release);
  stream_->end_request();
  stream_.reset();
}

// The server's completion queue is read by one thread at a time, the one
// holding the polling role. It runs a request it reads itself (unless the
// caller said more of its requests are in flight: those go to `offload`),
// so that a request reaches its function with no thread hop, its reply goes
// out before the stream's next read is posted (whose WINDOW_UPDATE then
// follows the reply instead of waking the caller on its own), and only one
// thread in the process wakes for each segment that arrives. A request that
// runs longer than a watchdog tick or two (it blocks, or waits for a later
// request) loses the role: its stream's next read is posted and an idle
// thread (started if none) takes over the queue.
class TransportServer::Service {
 public:
  Service(OnRequest run_inline, OnRequest offload)
      : run_inline_(std::move(run_inline)), offload_(std::move(offload)) {}

  ~Service() { stop_threads(); }

  grpc::AsyncGenericService* generic() { return &generic_; }

  void start(std::unique_ptr<grpc::ServerCompletionQueue> cq) {
    cq_ = std::move(cq);
    accept_next();
    absl::MutexLock lock(&mu_);
    for (int i = 0; i < 2; ++i) spawn_thread();
    watchdog_ = std::thread([this] { watchdog_loop(); });
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
    {
      // The watchdog keeps handing the role on until the queue is drained.
      absl::MutexLock lock(&mu_);
      auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return drained_; };
      mu_.Await(absl::Condition(&drained));
      watchdog_stop_ = true;
    }
    if (watchdog_.joinable()) watchdog_.join();
    std::vector<std::thread> threads;
    {
      absl::MutexLock lock(&mu_);
      threads.swap(threads_);
    }
    for (auto& t : threads) t.join();
    for (auto& s : streams) s->release();  // every operation has completed
    absl::MutexLock lock(&mu_);
    streams_.clear();
  }

 private:
  // How often the watchdog looks at the request run by the polling thread;
  // one found running at two ticks in a row loses the role.
  static constexpr absl::Duration kWatchdogTick = absl::Milliseconds(5);
  // Threads blocked in long requests beyond this many stop requests from
  // running inline: the rest go to `offload`.
  static constexpr int kMaxThreads = 64;  // busy ones: not waiting for the role

  void accept_next() {
    auto s = std::make_shared<ServerStream>();
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
    std::shared_ptr<ServerStream> keep;
    absl::MutexLock lock(&mu_);
    auto it = streams_.find(s);
    if (it == streams_.end()) return;
    keep = std::move(it->second);
    streams_.erase(it);
    s->release();
  }

  void spawn_thread() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    threads_.emplace_back([this] { poll_loop(); });
  }

  void poll_loop() {
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        ++idle_;
        auto can_poll = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return role_free_ || drained_;
        };
        mu_.Await(absl::Condition(&can_poll));
        --idle_;
        if (drained_) return;
        role_free_ = false;
      }
      // This thread holds the role until the queue is drained or the
      // watchdog takes the role from a request it runs.
      while (true) {
        void* got = nullptr;
        bool ok = false;
        if (!cq_->Next(&got, &ok)) {
          absl::MutexLock lock(&mu_);
          drained_ = true;
          return;
        }
        const auto* tag = static_cast<ServerStream::Tag*>(got);
        // Held while handling: stop() may forget a finished stream meanwhile.
        std::shared_ptr<ServerStream> stream = find(tag->stream);
        if (stream && !handle(stream, tag->op, ok)) break;
      }
    }
  }

  // Handles one completion; false when this thread lost the polling role.
  bool handle(const std::shared_ptr<ServerStream>& stream, ServerStream::Op op, bool ok) {
    ServerStream* s = stream.get();
    switch (op) {
      case ServerStream::kAccept: {
        s->accept_done();
        if (!ok) {  // the server is shutting down
          settle_unaccepted(s);
          return true;
        }
        accept_next();
        if (s->context()->method() != kStreamMethod) {
          s->fail(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "unknown method"));
        } else {
          s->read_next();
        }
        settle(s);
        return true;
      }
      case ServerStream::kRead:
        return on_read(stream, ok);
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
    absl::MutexLock lock(&mu_);
    auto it = streams_.find(s);
    if (it == streams_.end()) return;
    auto keep = std::move(it->second);
    streams_.erase(it);
    s->release();
  }

  bool on_read(const std::shared_ptr<ServerStream>& self, bool ok) {
    ServerStream* s = self.get();
    grpc::ByteBuffer buffer;
    if (!s->take_read(ok, &buffer)) {  // the caller closed the stream, or it broke
      settle(s);
      return true;
    }
    Frame frame;
    absl::Status parsed = parse_frame(buffer, &frame);
    if (!parsed.ok()) {
      LOG(ERROR) << "rpc transport: dropping stream from " << s->context()->peer()
                 << ": malformed frame: " << parsed.message();
      s->fail(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                           absl::StrCat("malformed frame: ", parsed.message())));
      settle(s);
      return true;
    }
    auto responder = std::make_shared<Responder>(self);
    uint64_t seq = 0;
    {
      absl::MutexLock lock(&mu_);
      // The caller has more requests coming: keep reading while this runs.
      if (!frame.header.more_in_flight() &&
          static_cast<int>(threads_.size()) - idle_ < kMaxThreads) {
        seq = ++inline_seq_;
        inline_active_ = true;
        inline_stream_ = self;
      }
    }
    if (seq == 0) {
      s->read_next();
      offload_(std::move(responder), std::move(frame));
      return true;
    }
    wake_watchdog();
    const std::weak_ptr<Responder> mine = responder;
    run_inline_(std::move(responder), std::move(frame));
    bool kept;
    {
      absl::MutexLock lock(&mu_);
      kept = inline_active_ && inline_seq_ == seq;
      if (kept) {
        inline_active_ = false;
        inline_stream_.reset();
      }
    }
    // After the reply, if it is ready; a no-op if the watchdog posted it.
    const std::shared_ptr<Responder> still_held = mine.lock();
    if (s->defer_read(still_held && !still_held->answered())) {
      absl::MutexLock lock(&mu_);
      deferred_.push_back({self, watchdog_ticks_});
      watchdog_parked_.store(false, std::memory_order_relaxed);
    }
    return kept;
  }

  void wake_watchdog() {
    if (!watchdog_parked_.load(std::memory_order_relaxed)) return;
    absl::MutexLock lock(&mu_);
    watchdog_parked_.store(false, std::memory_order_relaxed);
  }

  // Ticks while a request runs inline; parks after a tick that saw none.
  void watchdog_loop() {
    absl::MutexLock lock(&mu_);
    while (!watchdog_stop_) {
      auto stop_now = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return watchdog_stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&stop_now), kWatchdogTick);
      if (watchdog_stop_) return;
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
      // Parked before the look: a request that starts inline after it finds
      // the flag set and unparks us.
      watchdog_parked_.store(deferred_.empty(), std::memory_order_relaxed);
      if (inline_active_) {
        watchdog_parked_.store(false, std::memory_order_relaxed);
        if (inline_seq_ == watchdog_seq_) {  // the same request as last tick
          inline_active_ = false;
          std::shared_ptr<ServerStream> stream = std::move(inline_stream_);
          role_free_ = true;
          if (idle_ == 0 && !drained_) spawn_thread();
          mu_.Unlock();
          stream->read_next();
          stream.reset();
          mu_.Lock();
        }
        watchdog_seq_ = inline_seq_;
      } else {
        auto unparked = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return watchdog_stop_ || !watchdog_parked_.load(std::memory_order_relaxed);
        };
        mu_.Await(absl::Condition(&unparked));
      }
    }
  }

  const OnRequest run_inline_;
  const OnRequest offload_;
  grpc::AsyncGenericService generic_;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::thread watchdog_;
  std::atomic<bool> watchdog_parked_{false};
  absl::Mutex mu_;
  // State below is protected by mu_.
  absl::flat_hash_map<ServerStream*, std::shared_ptr<ServerStream>> streams_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;           // threads waiting for the role
  bool role_free_ ABSL_GUARDED_BY(mu_) = true;  // no thread reads the queue
  bool inline_active_ ABSL_GUARDED_BY(mu_) = false;  // the role holder runs a request
  std::shared_ptr<ServerStream> inline_stream_ ABSL_GUARDED_BY(mu_);
  uint64_t inline_seq_ ABSL_GUARDED_BY(mu_) = 0;    // inline requests started
  uint64_t watchdog_seq_ ABSL_GUARDED_BY(mu_) = 0;  // inline_seq_ at the last tick
  uint64_t watchdog_ticks_ ABSL_GUARDED_BY(mu_) = 0;
  struct Deferred {
    std::shared_ptr<ServerStream> stream;
    uint64_t since;  // watchdog_ticks_ when deferred
  };
  std::vector<Deferred> deferred_ ABSL_GUARDED_BY(mu_);  // streams with a deferred read
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;      // stop(): no new streams
  bool cq_shutdown_ ABSL_GUARDED_BY(mu_) = false;
  bool drained_ ABSL_GUARDED_BY(mu_) = false;       // the queue returned its end
  bool watchdog_stop_ ABSL_GUARDED_BY(mu_) = false;
};

std::unique_ptr<TransportServer> TransportServer::start(const std::string& host,
                                                        OnRequest run_inline, OnRequest offload) {
  std::unique_ptr<TransportServer> s(new TransportServer());
  s->service_ = std::make_unique<Service>(std::move(run_inline), std::move(offload));
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(host, ":0"), grpc::InsecureServerCredentials(), &s->port_);
  builder.SetMaxReceiveMessageSize(INT_MAX);
  builder.SetMaxSendMessageSize(INT_MAX);
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

namespace {
// The ClientQueue whose reading role this thread holds, if any.
thread_local const ClientQueue* t_reading = nullptr;

class ReadingScope {
 public:
  explicit ReadingScope(const ClientQueue* queue) : saved_(t_reading) { t_reading = queue; }
  ~ReadingScope() { t_reading = saved_; }

 private:
  const ClientQueue* const saved_;
};
}  // namespace

ClientQueue::ClientQueue() : background_([this] { background_loop(); }) {}

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

void ClientQueue::reserve() {
  absl::MutexLock lock(&mu_);
  ++reserved_;
}

void ClientQueue::unreserve() {
  absl::MutexLock lock(&mu_);
  if (reserved_ > 0) --reserved_;
}

bool ClientQueue::reading_here() const { return t_reading == this; }

bool ClientQueue::read_if_free(const std::function<bool()>& done, absl::Time deadline) {
  if (reading_here()) {  // nested: a callback run by this thread waits
    run_events(done, deadline);
    return true;
  }
  {
    absl::MutexLock lock(&mu_);
    if (driving_ || drained_) return false;
    driving_ = true;
  }
  {
    ReadingScope scope(this);
    run_events(done, deadline);
  }
  absl::MutexLock lock(&mu_);
  driving_ = false;
  return true;
}

void ClientQueue::drive(const std::function<bool()>& done, absl::Time deadline) {
  while (!read_if_free(done, deadline)) {
    absl::MutexLock lock(&mu_);
    // done() is evaluated under mu_: the reader takes mu_ after each event.
    auto role_or_done = [this, &done]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !driving_ || drained_ || done();
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
    switch (cq_.AsyncNext(&got, &ok, absl::ToChronoTime(until))) {
      case grpc::CompletionQueue::SHUTDOWN: {
        absl::MutexLock lock(&mu_);
        drained_ = true;
        return;
      }
      case grpc::CompletionQueue::TIMEOUT:
        if (absl::Now() >= deadline) return;
        break;
      case grpc::CompletionQueue::GOT_EVENT: {
        const auto* tag = static_cast<const Tag*>(got);
        const int op = tag->op;
        // Dropped after the count: the stream may go with it.
        std::shared_ptr<PeerStream> ended = tag->stream->on_event(op, ok);
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
        return drained_ || (!driving_ && want_role_ == 0 &&
                            (shutting_down_ || (pending_ > 0 && reserved_ == 0)));
      };
      mu_.Await(absl::Condition(&ready));
      if (drained_) return;
      driving_ = true;
    }
    // Reads until nothing is outstanding, or a caller reserves the queue or
    // waits for the role (that caller reads from here on).
    {
      ReadingScope scope(this);
      run_events(
          [this] {
            absl::MutexLock lock(&mu_);
            if (shutting_down_) return false;  // read until drained
            return pending_ == 0 || reserved_ > 0 || want_role_ > 0;
          },
          absl::InfiniteFuture());
    }
    absl::MutexLock lock(&mu_);
    driving_ = false;
  }
}

std::shared_ptr<PeerStream> PeerStream::open(const std::string& address, ClientQueue* queue,
                                             OnFrame on_frame, OnClose on_close) {
  std::shared_ptr<PeerStream> s(
      new PeerStream(address, queue, std::move(on_frame), std::move(on_close)));
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

PeerStream::PeerStream(const std::string& address, ClientQueue* queue, OnFrame on_frame,
                       OnClose on_close)
    : on_frame_(std::move(on_frame)),
      on_close_(std::move(on_close)),
      client_queue_(queue),
      channel_(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                         channel_arguments())) {
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
  return read_failed_ || (writes_closed_ && !closing_);
}

bool PeerStream::send(grpc::ByteBuffer frame, bool expects_reply) {
  void* write_tag = nullptr;
  void* read_tag = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (writes_closed_ || closing_) return false;
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

std::shared_ptr<PeerStream> PeerStream::on_event(int op, bool ok) {
  if (op == kStart) return nullptr;
  handle(static_cast<Op>(op), ok);
  absl::MutexLock lock(&mu_);
  --ops_pending_;
  if (finished_ && ops_pending_ == 0) return std::move(self_);
  return nullptr;
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
    case kRead: {
      // read_pending_ stays set until read_buffer_ is parsed: a send that
      // posted the next read now would have it overwritten.
      if (!ok) {
        read_failed(grpc::Status::OK);
        return;
      }
      Frame frame;
      absl::Status parsed = parse_frame(read_buffer_, &frame);
      read_buffer_.Clear();
      if (!parsed.ok()) {
        ctx_.TryCancel();
        read_failed(grpc::Status(grpc::StatusCode::DATA_LOSS,
                                 absl::StrCat("malformed reply frame: ", parsed.message())));
        return;
      }
      {
        absl::MutexLock lock(&mu_);
        read_pending_ = false;
        if (expecting_ > 0) --expecting_;
        // Reading on only while replies are due (or the stream is closing and
        // its end must be seen): a read posted on an idle stream sends a
        // WINDOW_UPDATE that wakes the peer for nothing.
        if ((expecting_ > 0 || closing_) && claim_read()) {
          call_->Read(&read_buffer_, post(kRead));
        }
      }
      on_frame_(std::move(frame));
      return;
    }
    case kFinish: {
      grpc::Status status;
      {
        absl::MutexLock lock(&mu_);
        finished_ = true;  // writes closed and queue cleared when the read failed
        status = read_status_.ok() ? finish_status_ : read_status_;
      }
      on_close_(status);
      return;
    }
  }
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

void PeerStream::close(bool graceful) {
  const std::function<bool()> over = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return finished_ && ops_pending_ == 0;
  };
  {
    absl::MutexLock lock(&mu_);
    if (closing_) return;
    closing_ = true;
    // The stream's end (the peer's, or our cancel below) arrives as a failed
    // read, which starts Finish.
    if (claim_read()) call_->Read(&read_buffer_, post(kRead));
    if (graceful && !writes_closed_) {
      if (write_in_flight_) {
        half_close_ = true;
      } else {
        writes_closed_ = true;
        call_->WritesDone(post(kWritesDone));
      }
      // The peer ends the stream once it has answered everything it received.
      wait_reading([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return finished_; },
                   absl::Now() + absl::Seconds(5));
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

}  // namespace ddprpc::rpc::internal
