#include "rpc/store.h"

#include <grpcpp/grpcpp.h>

#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "rpc/errors.h"
#include "rpc/wire.grpc.pb.h"

namespace ddprpc::rpc {

class StoreServer::Service final : public wire::Store::Service {
 public:
  grpc::Status Set(grpc::ServerContext*, const wire::StoreRequest* req,
                   wire::StoreResponse*) override {
    absl::MutexLock lock(&mu_);
    data_[req->key()] = req->value();
    return grpc::Status::OK;
  }

  grpc::Status Get(grpc::ServerContext* ctx, const wire::StoreRequest* req,
                   wire::StoreResponse* resp) override {
    absl::MutexLock lock(&mu_);
    if (!await_keys(ctx, {req->key()}, req->timeout_ms())) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat("timed out waiting for key '", req->key(), "'"));
    }
    resp->set_value(data_[req->key()]);
    return grpc::Status::OK;
  }

  grpc::Status Add(grpc::ServerContext*, const wire::StoreRequest* req,
                   wire::StoreResponse* resp) override {
    absl::MutexLock lock(&mu_);
    int64_t current = 0;
    auto it = data_.find(req->key());
    if (it != data_.end() && !absl::SimpleAtoi(it->second, &current)) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("key '", req->key(), "' does not hold an integer"));
    }
    current += req->amount();
    data_[req->key()] = absl::StrCat(current);
    resp->set_number(current);
    return grpc::Status::OK;
  }

  grpc::Status Wait(grpc::ServerContext* ctx, const wire::StoreRequest* req,
                    wire::StoreResponse*) override {
    absl::MutexLock lock(&mu_);
    std::vector<std::string> keys(req->keys().begin(), req->keys().end());
    if (!await_keys(ctx, keys, req->timeout_ms())) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat("timed out waiting for keys ", absl::StrJoin(keys, ", ")));
    }
    return grpc::Status::OK;
  }

  grpc::Status Check(grpc::ServerContext*, const wire::StoreRequest* req,
                     wire::StoreResponse* resp) override {
    absl::MutexLock lock(&mu_);
    bool all = true;
    for (const auto& k : req->keys()) all = all && data_.count(k) > 0;
    resp->set_number(all ? 1 : 0);
    return grpc::Status::OK;
  }

  void stop() {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }

 private:
  // Waits (with mu_ held) until all keys exist; false on timeout or stop.
  bool await_keys(grpc::ServerContext* ctx, const std::vector<std::string>& keys,
                  int64_t timeout_ms) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::Time deadline = absl::Now() + absl::Milliseconds(timeout_ms);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (stopping_) return true;
      for (const auto& k : keys) {
        if (!data_.count(k)) return false;
      }
      return true;
    };
    // Wake up periodically to notice a cancelled client.
    while (!mu_.AwaitWithDeadline(absl::Condition(&ready),
                                  std::min(deadline, absl::Now() + absl::Milliseconds(200)))) {
      if (ctx->IsCancelled() || absl::Now() >= deadline) return false;
    }
    return !stopping_;
  }

  absl::Mutex mu_;
  std::map<std::string, std::string> data_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

std::unique_ptr<StoreServer> StoreServer::start(const std::string& host, int port) {
  std::unique_ptr<StoreServer> s(new StoreServer());
  s->service_ = std::make_unique<Service>();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(host, ":", port), grpc::InsecureServerCredentials(),
                           &s->port_);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
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
