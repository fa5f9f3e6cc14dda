#include "rpc/store.h"

#include <grpcpp/grpcpp.h>

#include <grpcpp/resource_quota.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "rpc/errors.h"
#include "rpc/internal/fault.h"
#include "rpc/internal/store_state.h"
#include "rpc/wire.grpc.pb.h"

namespace ddprpc::rpc {

class StoreServer::Service final : public wire::Store::Service {
 public:
  grpc::Status Set(grpc::ServerContext* ctx, const wire::StoreRequest* req,
                   wire::StoreResponse* resp) override {
    return guarded(ctx, "set", [&] { return state_.set(*req, resp); });
  }
  grpc::Status Get(grpc::ServerContext* ctx, const wire::StoreRequest* req,
                   wire::StoreResponse* resp) override {
    return guarded(ctx, "get",
                   [&] { return state_.get(*req, resp, [ctx] { return ctx->IsCancelled(); }); });
  }
  grpc::Status Add(grpc::ServerContext* ctx, const wire::StoreRequest* req,
                   wire::StoreResponse* resp) override {
    return guarded(ctx, "add", [&] { return state_.add(*req, resp); });
  }
  grpc::Status Wait(grpc::ServerContext* ctx, const wire::StoreRequest* req,
                    wire::StoreResponse* resp) override {
    return guarded(ctx, "wait",
                   [&] { return state_.wait(*req, resp, [ctx] { return ctx->IsCancelled(); }); });
  }
  grpc::Status Check(grpc::ServerContext* ctx, const wire::StoreRequest* req,
                     wire::StoreResponse* resp) override {
    return guarded(ctx, "check", [&] { return state_.check(*req, resp); });
  }

  void stop() { state_.stop(); }

 private:
  // Runs one request; what it throws becomes its error status, and a
  // refused request is logged with the client's address.
  template <typename F>
  grpc::Status guarded(grpc::ServerContext* ctx, const char* op, F&& run) {
    grpc::Status status;
    try {
      internal::fault_point("store.request");
      status = run();
    } catch (const std::exception& e) {
      status = grpc::Status(grpc::StatusCode::INTERNAL, e.what());
    }
    const grpc::StatusCode code = status.error_code();
    if (code != grpc::StatusCode::OK && code != grpc::StatusCode::DEADLINE_EXCEEDED &&
        code != grpc::StatusCode::UNAVAILABLE) {
      LOG(WARNING) << "rendezvous store: refused " << op << " from " << ctx->peer() << ": "
                   << status.error_message();
    }
    return status;
  }

  internal::StoreState state_;
};

std::unique_ptr<StoreServer> StoreServer::start(const std::string& host, int port) {
  std::unique_ptr<StoreServer> s(new StoreServer());
  s->service_ = std::make_unique<Service>();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(host, ":", port), grpc::InsecureServerCredentials(),
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
  // Blocked waits hold a thread each; the state refuses those beyond its
  // bound before this one is reached.
  grpc::ResourceQuota quota("ddprpc-store");
  quota.SetMaxThreads(internal::StoreState::kMaxWaiters + 64);
  builder.SetResourceQuota(quota);
  builder.RegisterService(s->service_.get());
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

Store::Store(const std::string& host, int port, absl::Duration timeout)
    : address_(absl::StrCat(host, ":", port)), timeout_(timeout) {
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
  channel_ = grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args);
}

Store::~Store() = default;

namespace {

using Method = grpc::Status (wire::Store::Stub::*)(grpc::ClientContext*, const wire::StoreRequest&,
                                                 wire::StoreResponse*);

wire::StoreResponse call(const std::shared_ptr<grpc::Channel>& channel, const std::string& address,
                         Method method, const char* what, const wire::StoreRequest& req,
                         absl::Duration timeout, bool fail_fast) {
  wire::Store::Stub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_wait_for_ready(!fail_fast);  // at rendezvous the server may not be up yet
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout + absl::Seconds(1)));
  wire::StoreResponse resp;
  grpc::Status status = (stub.*method)(&ctx, req, &resp);
  if (!status.ok()) {
    ErrorCode code = status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                         ? ErrorCode::kTimeout
                         : ErrorCode::kUnavailable;
    throw RpcError(code, absl::StrCat("rendezvous store at ", address, ": ", what, " '",
                                      req.key(), "' failed: ", status.error_message()));
  }
  return resp;
}

}  // namespace

void Store::set(const std::string& key, const std::string& value) {
  wire::StoreRequest req;
  req.set_key(key);
  req.set_value(value);
  call(channel_, address_, &wire::Store::Stub::Set, "set", req, timeout_, fail_fast_);
}

std::string Store::get(const std::string& key) {
  wire::StoreRequest req;
  req.set_key(key);
  req.set_timeout_ms(absl::ToInt64Milliseconds(timeout_));
  return call(channel_, address_, &wire::Store::Stub::Get, "get", req, timeout_, fail_fast_).value();
}

int64_t Store::add(const std::string& key, int64_t amount) {
  wire::StoreRequest req;
  req.set_key(key);
  req.set_amount(amount);
  return call(channel_, address_, &wire::Store::Stub::Add, "add", req, timeout_, fail_fast_).number();
}

void Store::wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  wire::StoreRequest req;
  for (const auto& k : keys) req.add_keys(k);
  req.set_key(absl::StrJoin(keys, ","));
  req.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  call(channel_, address_, &wire::Store::Stub::Wait, "wait", req, timeout, fail_fast_);
}

bool Store::check(const std::vector<std::string>& keys) {
  wire::StoreRequest req;
  for (const auto& k : keys) req.add_keys(k);
  return call(channel_, address_, &wire::Store::Stub::Check, "check", req, timeout_, fail_fast_).number() == 1;
}

}  // namespace ddprpc::rpc
