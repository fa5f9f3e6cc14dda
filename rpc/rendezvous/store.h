// Rendezvous key/value store, like torch.distributed.TCPStore.
//
// One process hosts a StoreServer (rank 0 at init_method tcp://host:port);
// every process talks to it through a Store client over gRPC. get() and
// wait() block until the keys exist; every call fails with an RpcError
// (kTimeout or kUnavailable) instead of hanging past its timeout.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "rpc/core/security.h"

namespace grpc {
class Channel;
class Server;
}  // namespace grpc

namespace ddprpc::rpc {

class StoreServer {
 public:
  // Listens on host:port (port 0 picks a free one). With an authenticated
  // `security`, requests without the job's proof are refused
  // (UNAUTHENTICATED) before they are parsed; with TLS, clients need a
  // certificate from the job's CA. Throws RpcError when the address cannot
  // be bound.
  static std::unique_ptr<StoreServer> start(const std::string& host, int port,
                                            const Security& security = Security::from_environment());
  ~StoreServer();
  int port() const { return port_; }

  class Service;

 private:
  StoreServer() = default;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

class Store {
 public:
  // Calls wait up to `timeout` for the server to come up and for keys
  // (the server waits for keys 24 h at most per call: an infinite timeout
  // means that).
  Store(const std::string& host, int port, absl::Duration timeout,
        const Security& security = Security::from_environment());
  ~Store();

  void set(const std::string& key, const std::string& value);
  // Blocks until `key` is set.
  std::string get(const std::string& key);
  // Adds `amount` to the integer stored at `key` (0 if unset); returns the sum.
  int64_t add(const std::string& key, int64_t amount);
  // Blocks until every key is set, at most `timeout`.
  void wait(const std::vector<std::string>& keys, absl::Duration timeout);
  bool check(const std::vector<std::string>& keys);
  // Atomically stores `desired` at `key` when `key` holds `expected`, or
  // when `key` is unset and `expected` is empty (as c10d's
  // Store::compareSet). Returns what `key` holds afterwards, except that an
  // unset `key` with a non-empty `expected` stays unset and `expected` is
  // returned. The call stored `desired` when it returns `desired`, provided
  // no other caller stores that same value and `desired` != `expected`
  // (make it name the caller, e.g. "epoch:rank"). A store it cannot fit in
  // refuses it as set() does (nothing stored); what it stores wakes get()
  // and wait() on `key` as set() does. Like add(), a call the server
  // cancelled is not tried again: it may have taken effect.
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired);

  // By default calls wait for the server to come up (rendezvous); with
  // fail_fast they fail at once when it is unreachable (e.g. at shutdown).
  void set_fail_fast(bool fail_fast) { fail_fast_ = fail_fast; }

  absl::Duration timeout() const { return timeout_; }
  std::string address() const { return address_; }

  // Whether the job has a secret: every call carries a proof of it.
  bool authenticated() const { return !token_.empty(); }
  // A MAC of `message` under the job's secret (HMAC-SHA256, 64 hex digits),
  // for members that prove the secret to each other over connections of
  // their own, e.g. a process group's pairs; the secret itself never leaves
  // this object. Empty when the job has no secret.
  std::string sign(absl::string_view message) const;

 private:
  const std::string address_;
  const absl::Duration timeout_;
  const std::string token_;  // proves each call (security.h)
  std::shared_ptr<grpc::Channel> channel_;
  bool fail_fast_ = false;
};

}  // namespace ddprpc::rpc
