#include "rpc/rendezvous/store.h"

#include <grpcpp/grpcpp.h>

#include <grpcpp/impl/codegen/method_handler.h>
#include <grpcpp/resource_quota.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "rpc/errors.h"
#include "rpc/internal/auth.h"
#include "rpc/internal/fault.h"
#include "rpc/rendezvous/internal/store_state.h"
#include "rpc/rendezvous/store.grpc.pb.h"

namespace ddprpc::rpc {

// The store's methods take raw bytes: a request is authenticated (its
// metadata) before its protobuf is parsed.
class StoreServer::Service final : public grpc::Service {
 public:
  enum Method { kSet, kGet, kAdd, kWait, kCheck };

  explicit Service(const Security& security)
      : auth_(security.authenticated() ? std::make_unique<internal::AuthChecker>(security.token)
                                       : nullptr) {
    static const char* const kNames[] = {"/ddprpc.rendezvous.Store/Set", "/ddprpc.rendezvous.Store/Get",
                                         "/ddprpc.rendezvous.Store/Add", "/ddprpc.rendezvous.Store/Wait",
                                         "/ddprpc.rendezvous.Store/Check"};
    for (int m = kSet; m <= kCheck; ++m) {
      AddMethod(new grpc::internal::RpcServiceMethod(
          kNames[m], grpc::internal::RpcMethod::NORMAL_RPC,
          new grpc::internal::RpcMethodHandler<Service, grpc::ByteBuffer, grpc::ByteBuffer>(
              [m](Service* service, grpc::ServerContext* ctx, const grpc::ByteBuffer* req,
                  grpc::ByteBuffer* resp) {
                return service->handle(static_cast<Method>(m), ctx, *req, resp);
              },
              this)));
    }
  }

  void stop() { state_.stop(); }

 private:
  // Runs one request; what it throws becomes its error status, and a
  // refused request is logged with the client's address.
  grpc::Status handle(Method method, grpc::ServerContext* ctx, const grpc::ByteBuffer& raw,
                      grpc::ByteBuffer* raw_resp) {
    static const char* const kOps[] = {"set", "get", "add", "wait", "check"};
    grpc::Status status;
    try {
      internal::fault_point("store.request");
      if (auth_) status = auth_->check(ctx->client_metadata(), "store", -1);
      rendezvous::StoreRequest req;
      rendezvous::StoreResponse resp;
      if (status.ok() && !parse(raw, &req)) {
        status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "malformed store request");
      }
      if (status.ok()) {
        auto cancelled = [ctx] { return ctx->IsCancelled(); };
        switch (method) {
          case kSet: status = state_.set(req, &resp); break;
          case kGet: status = state_.get(req, &resp, cancelled); break;
          case kAdd: status = state_.add(req, &resp); break;
          case kWait: status = state_.wait(req, &resp, cancelled); break;
          case kCheck: status = state_.check(req, &resp); break;
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
  grpc::ClientContext ctx;
  if (!token.empty()) ctx.AddMetadata(internal::kAuthMetadataKey, internal::auth_proof(token, "store", -1));
  ctx.set_wait_for_ready(!fail_fast);  // at rendezvous the server may not be up yet
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout + absl::Seconds(1)));
  rendezvous::StoreResponse resp;
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
  rendezvous::StoreRequest req;
  req.set_key(key);
  req.set_value(value);
  call(channel_, address_, token_, &rendezvous::Store::Stub::Set, "set", req, timeout_, fail_fast_);
}

std::string Store::get(const std::string& key) {
  rendezvous::StoreRequest req;
  req.set_key(key);
  req.set_timeout_ms(absl::ToInt64Milliseconds(timeout_));
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
  req.set_key(absl::StrJoin(keys, ","));
  req.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  call(channel_, address_, token_, &rendezvous::Store::Stub::Wait, "wait", req, timeout, fail_fast_);
}

bool Store::check(const std::vector<std::string>& keys) {
  rendezvous::StoreRequest req;
  for (const auto& k : keys) req.add_keys(k);
  return call(channel_, address_, token_, &rendezvous::Store::Stub::Check, "check", req, timeout_, fail_fast_).number() == 1;
}

}  // namespace ddprpc::rpc
