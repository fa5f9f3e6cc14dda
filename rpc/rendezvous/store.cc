#include "rpc/rendezvous/store.h"

#include <grpcpp/grpcpp.h>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/resource_quota.h>

#include <algorithm>
#include <deque>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "rpc/core/errors.h"
#include "rpc/core/internal/auth.h"
#include "rpc/core/internal/fault.h"
#include "rpc/rendezvous/internal/store_state.h"
#include "rpc/rendezvous/store.grpc.pb.h"

namespace ddprpc::rpc {

namespace {

// What the server lets connections use before and after they prove the
// token (docs/security.md).
constexpr size_t kStoreMemoryBytes = size_t{256} << 20;  // gRPC's buffers, all connections
constexpr int kStoreStreamsPerConnection = 32;
constexpr int kStoreHandshakeMs = 10000;     // TLS and the HTTP/2 preface
constexpr int kStoreIdleConnectionMs = 30000;  // a connection without calls
// Requests that run at once (blocked get()/wait() hold one each; the state
// refuses waiters beyond its own bound first).
constexpr int kStoreMaxRunning = internal::StoreState::kMaxWaiters + 64;
// Proven calls whose message is being read at once: what bounds the bytes
// a member's unfinished messages hold (each at most kMaxRequestBytes). The
// others wait their turn, unread (their stream's window stays at HTTP/2's
// initial one), up to kStoreMaxQueued; more are refused. A message not
// whole within kStoreReadTimeout cancels its call.
constexpr int kStoreMaxReading = 8;
constexpr int kStoreMaxQueued = 1024;
constexpr absl::Duration kStoreReadTimeout = absl::Seconds(10);

}  // namespace

// The store's methods take raw bytes through gRPC's callback API: a call is
// authenticated from its metadata when it arrives, before its message is
// asked for, so a stranger's request body is never read (HTTP/2 flow
// control holds it to the stream's initial window) nor parsed.
class StoreServer::Service final : public grpc::CallbackGenericService {
 public:
  enum Method { kSet, kGet, kAdd, kWait, kCheck, kCompareSet, kUnknown };

  explicit Service(const Security& security)
      : auth_(security.authenticated() ? std::make_unique<internal::AuthChecker>(security.token)
                                       : nullptr),
        reaper_([this] { reap_slow_reads(); }) {}

  // Waits for the threads of blocked requests (woken by stop()).
  ~Service() {
    {
      absl::MutexLock lock(&mu_);
      reaper_stop_ = true;
      auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_ == 0; };
      mu_.Await(absl::Condition(&none));
    }
    reaper_.join();
  }

  void stop() { state_.stop(); }

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    static const char* const kNames[] = {"/ddprpc.rendezvous.Store/Set", "/ddprpc.rendezvous.Store/Get",
                                         "/ddprpc.rendezvous.Store/Add", "/ddprpc.rendezvous.Store/Wait",
                                         "/ddprpc.rendezvous.Store/Check",
                                         "/ddprpc.rendezvous.Store/CompareSet"};
    static_assert(sizeof(kNames) / sizeof(kNames[0]) == kUnknown);
    Method method = kUnknown;
    for (int m = kSet; m < kUnknown; ++m) {
      if (ctx->method() == kNames[m]) method = static_cast<Method>(m);
    }
    grpc::Status status;
    if (method == kUnknown) {
      status = grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "no such store method");
    } else if (auth_) {
      status = auth_->check(ctx->client_metadata(), {"store", "grpc", -1, -1});
    }
    if (!status.ok()) {
      LOG_EVERY_N(WARNING, 100) << "rendezvous store: refused a call from " << ctx->peer() << ": "
                                << status.error_message();
      return new Refusal(status);
    }
    return new Call(this, ctx, method);
  }

 private:
  class Refusal : public grpc::ServerGenericBidiReactor {
   public:
    explicit Refusal(const grpc::Status& status) { Finish(status); }
    void OnDone() override { delete this; }
  };

  // One proven call: reads its request (when a reading slot is free), runs
  // it (blocking ones on their own thread), answers.
  class Call : public grpc::ServerGenericBidiReactor {
   public:
    Call(Service* service, grpc::GenericCallbackServerContext* ctx, Method method)
        : service_(service), ctx_(ctx), method_(method) {
      service_->want_read(this);
    }
    // Its turn to be read (called once, by want_read or by another call's
    // end of reading).
    void start_reading() { StartRead(&request_); }
    void OnCancel() override { service_->cancel_queued(this); }
    void OnReadDone(bool ok) override {
      service_->read_done(this);
      if (!ok) {
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no store request"));
        return;
      }
      if (method_ != kGet && method_ != kWait) {
        run();
        return;
      }
      if (!service_->enter()) {
        Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "too many store requests"));
        return;
      }
      try {
        std::thread([this, service = service_] {
          run();  // finishes the call: `this` may be gone after
          service->leave();
        }).detach();
      } catch (const std::exception&) {
        service_->leave();
        Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "no thread for the request"));
      }
    }
    void OnDone() override { delete this; }

   private:
    void run() {
      grpc::ByteBuffer response;
      grpc::Status status = service_->handle(method_, ctx_, &request_, &response);
      if (status.ok()) {
        response_ = std::move(response);
        StartWriteAndFinish(&response_, grpc::WriteOptions(), status);
      } else {
        Finish(status);
      }
    }
   public:
    Service* const service_;
    grpc::GenericCallbackServerContext* const ctx_;
    const Method method_;
    absl::Time reading_since_ = absl::InfiniteFuture();  // guarded by the service's mu_

   private:
    grpc::ByteBuffer request_;
    grpc::ByteBuffer response_;
  };

  // Reads `call` now if a slot is free, else queues it (or refuses it
  // when the queue is full).
  void want_read(Call* call) {
    bool now = false, refuse = false;
    {
      absl::MutexLock lock(&mu_);
      if (static_cast<int>(reading_.size()) < kStoreMaxReading) {
        call->reading_since_ = absl::Now();
        reading_.insert(call);
        now = true;
      } else if (static_cast<int>(queued_.size()) < kStoreMaxQueued) {
        queued_.push_back(call);
      } else {
        refuse = true;
      }
    }
    if (now) call->start_reading();
    if (refuse) {
      call->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "too many store requests"));
    }
  }
  // `call`'s read ended: the next queued call is read.
  void read_done(Call* call) {
    Call* next = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (reading_.erase(call) == 0) return;
      if (!queued_.empty()) {
        next = queued_.front();
        queued_.pop_front();
        next->reading_since_ = absl::Now();
        reading_.insert(next);
      }
    }
    if (next) next->start_reading();
  }
  // A queued call whose client went away ends without being read.
  void cancel_queued(Call* call) {
    {
      absl::MutexLock lock(&mu_);
      auto it = std::find(queued_.begin(), queued_.end(), call);
      if (it == queued_.end()) return;
      queued_.erase(it);
    }
    call->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }
  // Cancels the calls whose message has been read for kStoreReadTimeout.
  // Holding mu_ across TryCancel keeps each call alive (its read cannot end
  // meanwhile) and cannot deadlock: gRPC runs the reactions of a call it
  // cancels on its own threads, never inside TryCancel (these reactors are
  // not inlineable).
  void reap_slow_reads() {
    absl::MutexLock lock(&mu_);
    while (!reaper_stop_) {
      mu_.AwaitWithTimeout(absl::Condition(&reaper_stop_), absl::Milliseconds(500));
      const absl::Time now = absl::Now();
      for (Call* call : reading_) {
        if (now - call->reading_since_ >= kStoreReadTimeout) {
          call->reading_since_ = absl::InfiniteFuture();  // once
          call->ctx_->TryCancel();
        }
      }
    }
  }

  bool enter() {
    absl::MutexLock lock(&mu_);
    if (running_ >= kStoreMaxRunning) return false;
    ++running_;
    return true;
  }
  void leave() {
    absl::MutexLock lock(&mu_);
    --running_;
  }

  // Runs one request; what it throws becomes its error status, and a
  // refused request is logged with the client's address.
  // `raw` is released once parsed (a blocked request holds only its parse).
  grpc::Status handle(Method method, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* raw,
                      grpc::ByteBuffer* raw_resp) {
    static const char* const kOps[] = {"set", "get", "add", "wait", "check", "compare_set"};
    static_assert(sizeof(kOps) / sizeof(kOps[0]) == kUnknown);
    grpc::Status status;
    try {
      internal::fault_point("store.request");
      rendezvous::StoreRequest req;
      rendezvous::StoreResponse resp;
      if (!parse(*raw, &req)) {
        status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "malformed store request");
      }
      raw->Clear();
      if (status.ok()) {
        auto cancelled = [ctx] { return ctx->IsCancelled(); };
        switch (method) {
          case kSet: status = state_.set(req, &resp); break;
          case kGet: status = state_.get(req, &resp, cancelled); break;
          case kAdd: status = state_.add(req, &resp); break;
          case kWait: status = state_.wait(req, &resp, cancelled); break;
          case kCheck: status = state_.check(req, &resp); break;
          case kCompareSet: status = state_.compare_set(req, &resp); break;
          case kUnknown: status = grpc::Status(grpc::StatusCode::UNIMPLEMENTED, ""); break;
        }
      }
      if (status.ok()) {
        grpc::Slice slice(resp.SerializeAsString());
        *raw_resp = grpc::ByteBuffer(&slice, 1);
      }
    } catch (const std::exception& e) {
      status = grpc::Status(grpc::StatusCode::INTERNAL, e.what());
    }
    const grpc::StatusCode code = status.error_code();
    if (code != grpc::StatusCode::OK && code != grpc::StatusCode::DEADLINE_EXCEEDED &&
        code != grpc::StatusCode::UNAVAILABLE) {
      LOG(WARNING) << "rendezvous store: refused " << kOps[method] << " from " << ctx->peer()
                   << ": " << status.error_message();
    }
    return status;
  }

  static bool parse(const grpc::ByteBuffer& raw, rendezvous::StoreRequest* req) {
    std::vector<grpc::Slice> slices;
    if (!raw.Dump(&slices).ok()) return false;
    std::string bytes;
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    return req->ParseFromString(bytes);
  }

  const std::unique_ptr<internal::AuthChecker> auth_;
  internal::StoreState state_;
  absl::Mutex mu_;
  int running_ ABSL_GUARDED_BY(mu_) = 0;  // threads of blocking requests
  absl::flat_hash_set<Call*> reading_ ABSL_GUARDED_BY(mu_);
  std::deque<Call*> queued_ ABSL_GUARDED_BY(mu_);  // oldest first
  bool reaper_stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;  // last: started once the rest is built
};

std::unique_ptr<StoreServer> StoreServer::start(const std::string& host, int port,
                                               const Security& security) {
  std::unique_ptr<StoreServer> s(new StoreServer());
  s->service_ = std::make_unique<Service>(security);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(host, ":", port), internal::server_credentials(security),
                           &s->port_);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(internal::StoreState::kMaxRequestBytes);
  // Clients ping every few seconds (see Store::Store); a client that stops
  // answering this end's pings has its blocked requests cancelled.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  // Strangers: a connection finishes its handshake in time, opens few
  // streams, is closed once it has none for a while, and what gRPC
  // buffers for all connections together is bounded. A stream's window
  // stays at HTTP/2's initial one until its request is asked for (no
  // bandwidth probe), which happens once the call is proven.
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, kStoreHandshakeMs);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kStoreStreamsPerConnection);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, kStoreIdleConnectionMs);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  grpc::ResourceQuota quota("ddprpc-store");
  quota.Resize(kStoreMemoryBytes);
  quota.SetMaxThreads(kStoreMaxRunning);
  builder.SetResourceQuota(quota);
  builder.RegisterCallbackGenericService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->port_ == 0) {
    throw RpcError(ErrorCode::kUnavailable,
                   absl::StrCat("rendezvous store: cannot listen on ", host, ":", port,
                                " (address in use?)"));
  }
  return s;
}

StoreServer::~StoreServer() {
  if (!server_) return;
  service_->stop();
  // Blocked get()/wait() calls were woken by stop(); nothing else lingers.
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  server_->Wait();
}

Store::Store(const std::string& host, int port, absl::Duration timeout, const Security& security)
    : address_(absl::StrCat(host, ":", port)), timeout_(timeout), token_(security.token) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  // A store host that stops answering (stopped, cut off) fails calls within
  // seconds (UNAVAILABLE) instead of at their timeout.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  channel_ = grpc::CreateCustomChannel(address_, internal::channel_credentials(security), args);
}

Store::~Store() = default;

namespace {

using Method = grpc::Status (rendezvous::Store::Stub::*)(grpc::ClientContext*, const rendezvous::StoreRequest&,
                                                 rendezvous::StoreResponse*);

rendezvous::StoreResponse call(const std::shared_ptr<grpc::Channel>& channel, const std::string& address,
                         const std::string& token, Method method, const char* what,
                         const rendezvous::StoreRequest& req, absl::Duration timeout, bool fail_fast) {
  rendezvous::Store::Stub stub(channel);
  // A timeout already past still gives the call its round trip (the server
  // looks once).
  const absl::Time deadline =
      absl::Now() + std::max(timeout, absl::ZeroDuration()) + absl::Seconds(1);
  // A call that can run twice without harm (all but add and compare_set) is
  // tried again when the server cancelled it (a store host shutting down
  // while the job is still meeting), until its deadline, as one that finds
  // no server waits. A compare_set that took effect before its answer was
  // lost would, run again, answer what others stored since.
  const bool idempotent = std::string_view(what) != "add" && std::string_view(what) != "compare_set";
  rendezvous::StoreResponse resp;
  grpc::Status status;
  for (;;) {
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata(internal::kAuthMetadataKey, internal::auth_proof(token, {"store", "grpc", -1, -1}));
    ctx.set_wait_for_ready(!fail_fast);  // at rendezvous the server may not be up yet
    ctx.set_deadline(absl::ToChronoTime(deadline));
    status = (stub.*method)(&ctx, req, &resp);
    if (status.error_code() != grpc::StatusCode::CANCELLED || fail_fast || !idempotent ||
        absl::Now() + absl::Milliseconds(50) >= deadline) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  if (!status.ok()) {
    ErrorCode code = status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                         ? ErrorCode::kTimeout
                         : ErrorCode::kUnavailable;
    // The key, or the first of several and how many more.
    std::string subject = absl::StrCat("'", req.keys_size() > 0 ? req.keys(0) : req.key(), "'");
    if (req.keys_size() > 1) absl::StrAppend(&subject, " and ", req.keys_size() - 1, " more");
    throw RpcError(code, absl::StrCat("rendezvous store at ", address, ": ", what, " ", subject,
                                      " failed: ", status.error_message()));
  }
  return resp;
}

}  // namespace

std::string Store::sign(absl::string_view message) const {
  return token_.empty() ? std::string() : internal::member_mac(token_, message);
}

namespace {

// How long the server is to wait, as it takes it: from 0 (a deadline that
// has passed: look once) to its longest wait (an infinite timeout waits
// that long per call).
int64_t server_wait_ms(absl::Duration timeout) {
  return std::clamp<int64_t>(absl::ToInt64Milliseconds(timeout), 0,
                             internal::StoreState::kMaxTimeoutMs);
}

}  // namespace

void Store::set(const std::string& key, const std::string& value) {
  rendezvous::StoreRequest req;
  req.set_key(key);
  req.set_value(value);
  call(channel_, address_, token_, &rendezvous::Store::Stub::Set, "set", req, timeout_, fail_fast_);
}

std::string Store::get(const std::string& key) {
  rendezvous::StoreRequest req;
  req.set_key(key);
  req.set_timeout_ms(server_wait_ms(timeout_));
  return call(channel_, address_, token_, &rendezvous::Store::Stub::Get, "get", req, timeout_, fail_fast_).value();
}

int64_t Store::add(const std::string& key, int64_t amount) {
  rendezvous::StoreRequest req;
  req.set_key(key);
  req.set_amount(amount);
  return call(channel_, address_, token_, &rendezvous::Store::Stub::Add, "add", req, timeout_, fail_fast_).number();
}

void Store::wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  rendezvous::StoreRequest req;
  for (const auto& k : keys) req.add_keys(k);
  req.set_timeout_ms(server_wait_ms(timeout));
  call(channel_, address_, token_, &rendezvous::Store::Stub::Wait, "wait", req, timeout, fail_fast_);
}

bool Store::check(const std::vector<std::string>& keys) {
  rendezvous::StoreRequest req;
  for (const auto& k : keys) req.add_keys(k);
  return call(channel_, address_, token_, &rendezvous::Store::Stub::Check, "check", req, timeout_, fail_fast_).number() == 1;
}

std::string Store::compare_set(const std::string& key, const std::string& expected,
                               const std::string& desired) {
  rendezvous::StoreRequest req;
  req.set_key(key);
  req.set_value(expected);
  req.set_desired(desired);
  return call(channel_, address_, token_, &rendezvous::Store::Stub::CompareSet, "compare_set", req,
              timeout_, fail_fast_).value();
}

}  // namespace ddprpc::rpc
