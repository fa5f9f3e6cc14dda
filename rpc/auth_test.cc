// Only the job's own workers get in: connections without the job's token,
// with another token, replaying a proof, or (over TLS) without a
// certificate from the job's CA are refused on the RPC port and on the
// store, before anything they send is read; the job goes on serving. The
// local launcher gives its children a token with no configuration. Runs in
// plaintext (auth_test) and over mutual TLS (auth_tls_test).
#include <ATen/TensorOperators.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/ones.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "rpc/core/internal/auth.h"
#include "rpc/rendezvous/store.h"
#include "rpc/rpc.h"
#include "rpc/testing/raw_peer.h"
#include "tests/multiprocess.h"

namespace rpc = ddprpc::rpc;
namespace mp = ddprpc::testing;
namespace wire = ddprpc::wire;
using rpc::testing::RawStream;

namespace {

at::Tensor add(at::Tensor a, at::Tensor b) { return a + b; }
DDPRPC_REGISTER_FUNCTION(add);

std::string add_request() {
  at::Tensor t = at::ones({2});
  return rpc::testing::frame_bytes(
      rpc::testing::request_frame(0, 1, "add", {c10::IValue(t), c10::IValue(t)}));
}

// A raw stream that sends a valid request: answered, or refused with `code`.
void expect_stream(RawStream& stream, grpc::StatusCode code, const std::string& needle = "") {
  stream.write_bytes(add_request());
  auto reply = stream.read();
  if (code == grpc::StatusCode::OK) {
    ASSERT_TRUE(reply.has_value());
    EXPECT_EQ(reply->header.kind(), wire::RESPONSE);
    return;
  }
  EXPECT_FALSE(reply.has_value());
  grpc::Status status = stream.finish();
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_NE(status.error_message().find(needle), std::string::npos) << status.error_message();
}

void expect_serves() {
  at::Tensor t = at::ones({2});
  EXPECT_TRUE(at::equal(rpc::rpc_sync<at::Tensor>("worker1", "add", t, t), t + t));
}

std::string read(const char* env_path) {
  std::ifstream in(std::getenv(env_path));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

MULTIPROCESS_TEST(AuthTest, OnlyTheJobsWorkersGetIn, 2) {
  // The launcher gave every rank the same token, without being asked.
  ASSERT_NE(std::getenv("DDPRPC_AUTH_TOKEN"), nullptr);
  ASSERT_GE(std::string(std::getenv("DDPRPC_AUTH_TOKEN")).size(), 32u);
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  auto agent = rpc::current_agent();
  if (mp::rank() == 0) {
    const std::string victim = rpc::get_worker_info("worker1").address;
    const int to = rpc::get_worker_info("worker1").id;
    {
      RawStream stream(victim, to, 0);  // as the job's worker 0 would
      expect_stream(stream, grpc::StatusCode::OK);
    }
    {
      RawStream stream(victim, to, 0, absl::Seconds(20), "", RawStream::Auth::kNone);
      expect_stream(stream, grpc::StatusCode::UNAUTHENTICATED, "no proof of the job's token");
    }
    {
      RawStream stream(victim, to, 0, absl::Seconds(20), "", RawStream::Auth::kWrongToken);
      expect_stream(stream, grpc::StatusCode::UNAUTHENTICATED, "wrong job token");
    }
    {
      // A proof the job's worker 0 made for another destination (here
      // itself) does not open a stream to worker 1.
      RawStream stream(victim, mp::rank(), 0);
      expect_stream(stream, grpc::StatusCode::UNAUTHENTICATED, "wrong job token");
    }
    expect_serves();

    // The store refuses clients without the token, or with another.
    const std::string store_host = "127.0.0.1";
    const int store_port = std::atoi(std::getenv("MASTER_PORT"));
    rpc::Security none = rpc::Security::from_environment();
    none.token.clear();
    rpc::Security wrong = rpc::Security::from_environment();
    wrong.token = "not the job's token";
    for (const auto& [security, needle] : {std::make_pair(none, "no proof"),
                                           std::make_pair(wrong, "wrong job token")}) {
      rpc::Store intruder(store_host, store_port, absl::Seconds(5), security);
      intruder.set_fail_fast(true);
      try {
        intruder.get("rpc/worker/0");
        ADD_FAILURE() << "the store answered a client without the job's token";
      } catch (const rpc::RpcError& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    }
    EXPECT_FALSE(agent->store().get("rpc/worker/1").empty());  // the job's own client

    if (std::getenv("DDPRPC_TLS_CERT")) {
      // Over TLS: a plaintext client, one without a certificate, and one
      // with a certificate from another CA never get to send anything.
      grpc::SslCredentialsOptions no_cert;
      no_cert.pem_root_certs = read("DDPRPC_TLS_CA");
      grpc::SslCredentialsOptions other_ca;
      other_ca.pem_root_certs = read("DDPRPC_TLS_CA");
      other_ca.pem_cert_chain = read("OTHER_TLS_CERT");
      other_ca.pem_private_key = read("OTHER_TLS_KEY");
      for (auto credentials : {grpc::InsecureChannelCredentials(), grpc::SslCredentials(no_cert),
                               grpc::SslCredentials(other_ca)}) {
        RawStream stream(victim, to, 0, absl::Seconds(10), "", RawStream::Auth::kJobToken,
                         credentials);
        expect_stream(stream, grpc::StatusCode::UNAVAILABLE);
      }
      expect_serves();
    }
  }
  rpc::shutdown();
}

// A proof is good once: a recorded stream opening cannot be replayed.
TEST(AuthCheckerTest, RefusesReplaysOldProofsAndOtherPurposes) {
  rpc::internal::AuthChecker checker("secret");
  auto metadata = [](const std::string& proof) {
    static std::string key = rpc::internal::kAuthMetadataKey;
    static std::string value;
    value = proof;
    std::multimap<grpc::string_ref, grpc::string_ref> m;
    m.emplace(grpc::string_ref(key), grpc::string_ref(value));
    return m;
  };
  using rpc::internal::ProofScope;
  const ProofScope scope{"rpc", "grpc", 3, 1};
  const std::string proof = rpc::internal::auth_proof("secret", scope);
  EXPECT_TRUE(checker.check(metadata(proof), scope).ok());
  EXPECT_EQ(checker.check(metadata(proof), scope).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // One set of nonces per process: another server (another transport's,
  // the store's) refuses a proof one of them accepted.
  rpc::internal::AuthChecker other("secret");
  EXPECT_EQ(other.check(metadata(proof), scope).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // Bound to everything it was made for: the purpose, the transport, the
  // worker that opens it and the one it is opened to.
  for (const ProofScope& elsewhere :
       {ProofScope{"store", "grpc", 3, 1}, ProofScope{"rpc", "same-host", 3, 1},
        ProofScope{"rpc", "grpc", 4, 1}, ProofScope{"rpc", "grpc", 3, 2},
        ProofScope{"rpc", "grpc", 3, -1}}) {
    EXPECT_FALSE(checker.check(metadata(rpc::internal::auth_proof("secret", scope)), elsewhere).ok())
        << elsewhere.purpose << " " << elsewhere.transport << " " << elsewhere.from << " -> "
        << elsewhere.to;
  }
  // Out of the time window, and malformed.
  const std::string old = "1000.00112233445566778899aabbccddeeff." + std::string(64, 'a');
  EXPECT_NE(checker.check(metadata(old), scope).error_message().find("too old"), std::string::npos);
  EXPECT_FALSE(checker.check(metadata("garbage"), scope).ok());
}

}  // namespace
