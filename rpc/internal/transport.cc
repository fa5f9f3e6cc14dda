#include "rpc/internal/transport.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/impl/rpc_service_method.h>
#include <grpcpp/support/method_handler.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>

#include "absl/container/flat_hash_set.h"
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
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return args;
}

// ---------------------------------------------------------------- FrameWriter

bool FrameWriter::send(grpc::ByteBuffer buffer) {
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return false;
    queue_.push_back(std::move(buffer));
    if (writing_) return true;  // the active writer will send it
    writing_ = true;
  }
  while (true) {
    grpc::ByteBuffer next;
    grpc::WriteOptions options;
    {
      absl::MutexLock lock(&mu_);
      if (queue_.empty()) {
        writing_ = false;
        return true;
      }
      next = std::move(queue_.front());
      queue_.pop_front();
      if (!queue_.empty()) options.set_buffer_hint();
    }
    if (!write_(next, options)) {
      absl::MutexLock lock(&mu_);
      closed_ = true;
      queue_.clear();
      writing_ = false;
      return true;  // the stream's reader reports the failure
    }
  }
}

void FrameWriter::close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  queue_.clear();
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !writing_; };
  mu_.Await(absl::Condition(&idle));
}

// ------------------------------------------------------------- server side

// One accepted stream: its writer plus the count of requests not yet
// answered, so the handler does not return while replies are pending.
class ServerStream {
 public:
  explicit ServerStream(Stream* stream)
      : writer_([stream](const grpc::ByteBuffer& b, grpc::WriteOptions o) {
          return stream->Write(b, o);
        }) {}

  void begin_request() {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
  }
  void end_request() {
    absl::MutexLock lock(&mu_);
    --in_flight_;
  }
  void send(grpc::ByteBuffer b) { writer_.send(std::move(b)); }

  // Waits until every request is answered, or the call is cancelled, or
  // the server is stopping; then closes the writer.
  void drain(grpc::ServerContext* ctx, const bool* stopping, absl::Mutex* stop_mu) {
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
        if (mu_.AwaitWithTimeout(absl::Condition(&idle), absl::Milliseconds(50))) break;
      }
      if (ctx->IsCancelled()) break;
      absl::MutexLock lock(stop_mu);
      if (*stopping) break;
    }
    writer_.close();
  }

 private:
  FrameWriter writer_;
  absl::Mutex mu_;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

Responder::Responder(std::shared_ptr<ServerStream> stream) : stream_(std::move(stream)) {
  stream_->begin_request();
}

Responder::~Responder() {
  if (stream_) stream_->end_request();
}

void Responder::send(grpc::ByteBuffer reply) {
  if (!stream_) return;
  stream_->send(std::move(reply));
  stream_->end_request();
  stream_.reset();
}

class TransportServer::Service final : public grpc::Service {
 public:
  Service(OnRequest run_inline, OnRequest offload)
      : run_inline_(std::move(run_inline)), offload_(std::move(offload)) {
    AddMethod(new grpc::internal::RpcServiceMethod(
        kStreamMethod, grpc::internal::RpcMethod::BIDI_STREAMING,
        new grpc::internal::BidiStreamingHandler<Service, grpc::ByteBuffer, grpc::ByteBuffer>(
            [](Service* service, grpc::ServerContext* ctx, Stream* stream) {
              return service->run(ctx, stream);
            },
            this)));
    watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  ~Service() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      watchdog_stop_ = true;
    }
    watchdog_.join();
  }

  void stop() {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }

 private:
  // Two threads serve each stream, the gRPC handler thread and a helper.
  // The one holding the read token reads the next request and, if the other
  // is idle, runs it itself, keeping the token: a request reaches its
  // function without a thread hop, and the reply goes out before the next
  // read with no other thread polling the stream (gRPC would wake it). When
  // the caller says more of its requests are in flight, or a request runs
  // longer than a watchdog tick or two (it blocks, or waits for a later
  // request of the same caller), the token passes to the idle thread, which
  // keeps reading and sends what it reads to the worker pool until the
  // running request ends.
  struct Readers {
    absl::Mutex mu;
    bool token_free ABSL_GUARDED_BY(mu) = true;
    int idle ABSL_GUARDED_BY(mu) = 0;
    bool ended ABSL_GUARDED_BY(mu) = false;
    grpc::Status status ABSL_GUARDED_BY(mu);
    // The token holder is running a request inline (and holds the token).
    bool inline_holding ABSL_GUARDED_BY(mu) = false;
    uint64_t inline_seq ABSL_GUARDED_BY(mu) = 0;    // inline requests started
    uint64_t watchdog_seq ABSL_GUARDED_BY(mu) = 0;  // inline_seq at the last tick
  };

  // How often the watchdog looks for requests that hold a read token; one
  // found running at two ticks in a row loses the token.
  static constexpr absl::Duration kWatchdogTick = absl::Milliseconds(5);

  void serve_loop(grpc::ServerContext* ctx, Stream* stream,
                  const std::shared_ptr<ServerStream>& self, Readers* r) {
    while (true) {
      {
        absl::MutexLock lock(&r->mu);
        ++r->idle;
        auto can_read = [r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) {
          return r->token_free || r->ended;
        };
        r->mu.Await(absl::Condition(&can_read));
        --r->idle;
        if (r->ended) return;
        r->token_free = false;
      }
      // This thread holds the token until it ends the stream or the
      // watchdog takes the token from a request it runs.
      while (true) {
        grpc::ByteBuffer buffer;
        const bool got = stream->Read(&buffer);
        Frame frame;
        absl::Status parsed = got ? parse_frame(buffer, &frame) : absl::OkStatus();
        bool run_here, hand_on;
        {
          absl::MutexLock lock(&r->mu);
          if (!got || !parsed.ok()) {
            r->token_free = true;
            r->ended = true;
            if (!parsed.ok()) {
              LOG(ERROR) << "rpc transport: dropping stream from " << ctx->peer()
                         << ": malformed frame: " << parsed.message();
              r->status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                       absl::StrCat("malformed frame: ", parsed.message()));
            }
            return;
          }
          run_here = r->idle > 0;
          // The caller has more requests coming: the idle thread reads them
          // while this one runs (as when the watchdog hands reading on).
          hand_on = run_here && frame.header.more_in_flight();
          if (hand_on) {
            r->token_free = true;
          } else if (run_here) {
            r->inline_holding = true;
            ++r->inline_seq;
          }
        }
        auto responder = std::make_shared<Responder>(self);
        if (!run_here) {
          offload_(std::move(responder), std::move(frame));
          continue;
        }
        if (hand_on) {
          run_inline_(std::move(responder), std::move(frame));
          break;
        }
        wake_watchdog();
        run_inline_(std::move(responder), std::move(frame));
        absl::MutexLock lock(&r->mu);
        if (!r->inline_holding) break;  // the watchdog passed the token on
        r->inline_holding = false;
      }
    }
  }

  grpc::Status run(grpc::ServerContext* ctx, Stream* stream) {
    auto self = std::make_shared<ServerStream>(stream);
    Readers readers;
    {
      absl::MutexLock lock(&mu_);
      streams_.insert(&readers);
    }
    std::thread helper([&] { serve_loop(ctx, stream, self, &readers); });
    serve_loop(ctx, stream, self, &readers);
    helper.join();
    {
      absl::MutexLock lock(&mu_);
      streams_.erase(&readers);
    }
    self->drain(ctx, &stopping_, &mu_);
    absl::MutexLock lock(&readers.mu);
    return readers.status;
  }

  void wake_watchdog() {
    if (!watchdog_parked_.load(std::memory_order_relaxed)) return;
    absl::MutexLock lock(&mu_);
    watchdog_parked_.store(false, std::memory_order_relaxed);
  }

  // Ticks while requests run inline; parks after a tick that saw none. It
  // runs until the service is destroyed, so that streams still draining
  // after stop() keep their second reader.
  void watchdog_loop() {
    absl::MutexLock lock(&mu_);
    while (!watchdog_stop_) {
      auto stop_now = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return watchdog_stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&stop_now), kWatchdogTick);
      if (watchdog_stop_) return;
      // Parked before the scan: a stream that starts a request inline after
      // the scan looked at it finds the flag set and unparks us.
      watchdog_parked_.store(true, std::memory_order_relaxed);
      bool busy = false;
      for (Readers* r : streams_) {
        absl::MutexLock stream_lock(&r->mu);
        if (!r->inline_holding) continue;
        busy = true;
        if (r->inline_seq == r->watchdog_seq) {  // the same request as last tick
          r->inline_holding = false;
          r->token_free = true;  // wakes the stream's idle thread
        }
        r->watchdog_seq = r->inline_seq;
      }
      if (busy) {
        watchdog_parked_.store(false, std::memory_order_relaxed);
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
  std::thread watchdog_;
  std::atomic<bool> watchdog_parked_{false};
  absl::Mutex mu_;
  // State below is protected by mu_.
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;       // stop(): streams drain and end
  bool watchdog_stop_ ABSL_GUARDED_BY(mu_) = false;  // the service is going away
  absl::flat_hash_set<Readers*> streams_ ABSL_GUARDED_BY(mu_);
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
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::NUM_CQS, 1);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 1);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 1);
  builder.RegisterService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->port_ == 0) {
    throw RpcError(ErrorCode::kUnavailable,
                   absl::StrCat("rpc transport: cannot listen on ", host));
  }
  return s;
}

void TransportServer::shutdown(absl::Duration grace) {
  if (!server_) return;
  service_->stop();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server_->Wait();
  server_.reset();
}

TransportServer::~TransportServer() { shutdown(absl::ZeroDuration()); }

// -------------------------------------------------------------- client side

PeerStream::PeerStream(const std::string& address, OnFrame on_frame, OnClose on_close)
    : on_frame_(std::move(on_frame)),
      on_close_(std::move(on_close)),
      channel_(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                         channel_arguments())) {
  // Initial metadata goes out with the first frame, so opening never blocks.
  ctx_.set_initial_metadata_corked(true);
  grpc::GenericStub stub(channel_);
  call_ = stub.PrepareCall(&ctx_, kStreamMethod, &cq_);
  call_->StartCall(tag(kStart));
  background_ = std::thread([this] { background_loop(); });
}

PeerStream::~PeerStream() { close(/*graceful=*/false); }

bool PeerStream::broken() const {
  absl::MutexLock lock(&mu_);
  return read_failed_ || (writes_closed_ && !closing_);
}

bool PeerStream::has_work() const {
  // A failed read leads to Finish and the queue's shutdown, which must be
  // driven until the queue is drained.
  if (drained_) return false;
  return expecting_ > 0 || write_in_flight_ || closing_ || read_failed_;
}

bool PeerStream::send(grpc::ByteBuffer frame, bool expects_reply, bool caller_drives) {
  bool write_now, read_now;
  {
    absl::MutexLock lock(&mu_);
    if (writes_closed_ || closing_) return false;
    if (expects_reply) ++expecting_;
    if (caller_drives) ++reserved_;
    write_now = !write_in_flight_;
    if (write_now) {
      write_in_flight_ = true;  // this thread writes it, below
    } else {
      queue_.push_back(std::move(frame));
    }
    read_now = expecting_ > 0 && claim_read();
  }
  // Outside the lock: gRPC may write to the socket here. With
  // write_in_flight_ set, no other write, WritesDone or Finish starts
  // meanwhile; with read_pending_ set, no other read.
  if (write_now) write(frame, /*more=*/false);
  // After the write: the read's WINDOW_UPDATE follows the request at once
  // instead of waking the idle peer on its own.
  if (read_now) call_->Read(&read_buffer_, tag(kRead));
  return true;
}

bool PeerStream::claim_read() {
  if (read_pending_ || read_failed_) return false;
  read_pending_ = true;
  return true;
}

void PeerStream::write(const grpc::ByteBuffer& frame, bool more) {
  grpc::WriteOptions options;
  // Frames queued behind this one follow at once: let gRPC coalesce them.
  if (more) options.set_buffer_hint();
  call_->Write(frame, options, tag(kWrite));  // gRPC keeps its own reference
}

void PeerStream::unreserve() {
  absl::MutexLock lock(&mu_);
  if (reserved_ > 0) --reserved_;
}

void PeerStream::drive(const std::function<bool()>& done, absl::Time deadline, bool reserved) {
  {
    absl::MutexLock lock(&mu_);
    if (reserved && reserved_ > 0) --reserved_;
    if (driving_ || drained_) return;
    driving_ = true;
  }
  run_events(done, deadline);
  absl::MutexLock lock(&mu_);
  driving_ = false;
}

void PeerStream::run_events(const std::function<bool()>& done, absl::Time deadline) {
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
      case grpc::CompletionQueue::GOT_EVENT:
        handle(static_cast<Op>(static_cast<char*>(got) - tags_), ok);
        break;
    }
  }
}

void PeerStream::handle(Op op, bool ok) {
  switch (op) {
    case kStart:
    case kWritesDone:
    case kNumOps:
      return;  // a failed start shows up as a failed read
    case kWrite: {
      grpc::ByteBuffer next;
      bool more = false;
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
        } else if (half_close_ && !writes_closed_) {
          writes_closed_ = true;
          call_->WritesDone(tag(kWritesDone));
        }
        maybe_finish();  // once no write is in flight
      }
      if (next.Valid()) write(next, more);
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
          call_->Read(&read_buffer_, tag(kRead));
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
      cq_.Shutdown();  // the queue drains the remaining completions, then ends
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
  call_->Finish(&finish_status_, tag(kFinish));
}

void PeerStream::background_loop() {
  // A caller that said it would read but has not started within this long
  // (it dropped its future, or is descheduled) is not waited for.
  constexpr absl::Duration kReservationGrace = absl::Milliseconds(5);
  while (true) {
    bool take_over = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return drained_ || (!driving_ && has_work() && (reserved_ == 0 || closing_));
      };
      auto reserved_idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !driving_ && has_work() && reserved_ > 0 && !closing_;
      };
      auto ready_or_reserved = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return ready() || reserved_idle();
      };
      auto ready_or_not_reserved = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return ready() || !reserved_idle();
      };
      while (!ready()) {
        mu_.Await(absl::Condition(&ready_or_reserved));
        if (ready()) break;
        if (!mu_.AwaitWithTimeout(absl::Condition(&ready_or_not_reserved), kReservationGrace)) {
          take_over = true;
          break;
        }
      }
      if (drained_) return;
      driving_ = true;
    }
    run_events(
        [this, take_over] {
          absl::MutexLock lock(&mu_);
          return !has_work() || (!take_over && reserved_ > 0 && !closing_);
        },
        absl::InfiniteFuture());
    absl::MutexLock lock(&mu_);
    driving_ = false;
  }
}

void PeerStream::close(bool graceful) {
  {
    absl::MutexLock lock(&mu_);
    if (closing_) return;
    closing_ = true;
    // The stream's end (the peer's, or our cancel below) arrives as a failed
    // read, which starts Finish.
    if (claim_read()) call_->Read(&read_buffer_, tag(kRead));
    if (graceful && !writes_closed_) {
      if (write_in_flight_) {
        half_close_ = true;
      } else {
        writes_closed_ = true;
        call_->WritesDone(tag(kWritesDone));
      }
      // The peer ends the stream once it has answered everything it received.
      mu_.AwaitWithTimeout(absl::Condition(&finished_), absl::Seconds(5));
    }
    writes_closed_ = true;
  }
  ctx_.TryCancel();
  if (background_.joinable()) background_.join();
}

}  // namespace ddprpc::rpc::internal
