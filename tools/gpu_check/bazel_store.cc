// gpu_check's store under Bazel: a store server on a free loopback port,
// owned for the life of the process, and a client of it, both with a
// random token.
#include <memory>

#include "absl/time/time.h"
#include "rpc/security.h"
#include "tools/gpu_check/check_store.h"

namespace gpu_check {

std::shared_ptr<ddprpc::rpc::Store> make_store() {
  static const ddprpc::rpc::Security* security = [] {
    auto* s = new ddprpc::rpc::Security;
    s->token = ddprpc::rpc::Security::random_token();
    return s;
  }();
  static std::unique_ptr<ddprpc::rpc::StoreServer> server =
      ddprpc::rpc::StoreServer::start("127.0.0.1", 0, *security);
  return std::make_shared<ddprpc::rpc::Store>("127.0.0.1", server->port(), absl::Seconds(60),
                                              *security);
}

}  // namespace gpu_check
