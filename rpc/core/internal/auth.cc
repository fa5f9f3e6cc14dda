#include "rpc/core/internal/auth.h"

#include <openssl/crypto.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <fstream>
#include <tuple>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "rpc/core/errors.h"

namespace ddprpc::rpc {
namespace {

std::string read_file(const char* what, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw RpcError(ErrorCode::kInvalidArgument,
                   absl::StrCat("cannot read ", what, " file '", path, "'"));
  }
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

std::string random_hex(size_t bytes) {
  std::vector<unsigned char> buf(bytes);
  if (RAND_bytes(buf.data(), static_cast<int>(buf.size())) != 1) {
    throw RpcError(ErrorCode::kInternal, "no random bytes from OpenSSL");
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(buf.data()), buf.size()));
}

}  // namespace

Security Security::from_environment() { return Security().with_environment_defaults(); }

Security Security::with_environment_defaults() const {
  Security s = *this;
  if (s.token.empty()) {
    s.token = env_or_empty(kAuthTokenEnv);
    const std::string file = env_or_empty(kAuthTokenFileEnv);
    if (s.token.empty() && !file.empty()) {
      s.token = read_file("auth token", file);
      while (!s.token.empty() && (s.token.back() == '\n' || s.token.back() == '\r')) {
        s.token.pop_back();
      }
      if (s.token.empty()) {
        throw RpcError(ErrorCode::kInvalidArgument, "the auth token file '" + file + "' is empty");
      }
    }
  }
  if (s.tls_cert.empty() && s.tls_key.empty() && s.tls_ca.empty()) {
    const std::string cert = env_or_empty(kTlsCertEnv), key = env_or_empty(kTlsKeyEnv),
                      ca = env_or_empty(kTlsCaEnv);
    if (!cert.empty() || !key.empty() || !ca.empty()) {
      if (cert.empty() || key.empty() || ca.empty()) {
        throw RpcError(ErrorCode::kInvalidArgument,
                       absl::StrCat("TLS needs all of ", kTlsCertEnv, ", ", kTlsKeyEnv, " and ",
                                    kTlsCaEnv));
      }
      s.tls_cert = read_file("TLS certificate", cert);
      s.tls_key = read_file("TLS key", key);
      s.tls_ca = read_file("TLS CA", ca);
    }
  } else if (s.tls_cert.empty() || s.tls_key.empty() || s.tls_ca.empty()) {
    throw RpcError(ErrorCode::kInvalidArgument,
                   "TLS needs a certificate, its key and the CA, all three");
  }
  return s;
}

std::string Security::random_token() { return random_hex(32); }

namespace internal {
namespace {

std::string mac(const std::string& token, const std::string& message) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &len);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(out), len));
}

}  // namespace

std::string member_mac(const std::string& token, absl::string_view message) {
  return mac(token, absl::StrCat("ddprpc/2|member|", message));
}

namespace {

std::string signed_message(const ProofScope& scope, const std::string& ms,
                           const std::string& nonce) {
  return absl::StrCat("ddprpc/2|client-to-server|", scope.purpose, "|", scope.transport, "|",
                      scope.from, "|", scope.to, "|", ms, "|", nonce);
}

// The nonces of the proofs this process accepted (see AuthChecker), by
// the time each proof names, oldest first.
struct Nonces {
  absl::Mutex mu;
  // (unix ms, the nonce's 16 bytes as two words): 24 bytes an entry.
  absl::btree_set<std::tuple<int64_t, uint64_t, uint64_t>> seen ABSL_GUARDED_BY(mu);
  // Proofs naming this time (unix ms) or earlier are refused: a nonce of
  // theirs may have been forgotten to keep `seen` within its bound.
  int64_t floor_ms ABSL_GUARDED_BY(mu) = std::numeric_limits<int64_t>::min();
};
Nonces& process_nonces() {
  static auto* nonces = new Nonces();  // never destroyed: checkers may outlive main
  return *nonces;
}

grpc::Status refused(const std::string& why) {
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, why);
}

}  // namespace

std::string auth_proof(const std::string& token, const ProofScope& scope) {
  const std::string ms = absl::StrCat(absl::ToUnixMillis(absl::Now()));
  const std::string nonce = random_hex(16);
  return absl::StrCat(ms, ".", nonce, ".", mac(token, signed_message(scope, ms, nonce)));
}

grpc::Status AuthChecker::check(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                                const ProofScope& scope) {
  auto it = metadata.find(kAuthMetadataKey);
  if (it == metadata.end()) return refused("no proof of the job's token (ddprpc-auth metadata)");
  return check_proof(absl::string_view(it->second.data(), it->second.size()), scope);
}

grpc::Status AuthChecker::check_proof(absl::string_view proof, const ProofScope& scope) {
  std::vector<absl::string_view> parts = absl::StrSplit(proof, '.');
  int64_t ms = 0;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &ms) || parts[1].size() != 32 ||
      parts[2].size() != 64) {
    return refused("malformed proof of the job's token");
  }
  const absl::Time when = absl::FromUnixMillis(ms);
  const absl::Time now = absl::Now();
  if (when < now - kWindow || when > now + kWindow) {
    return refused("the proof of the job's token is too old or from the future (clock skew?)");
  }
  const std::string expected =
      mac(token_, signed_message(scope, std::string(parts[0]), std::string(parts[1])));
  if (CRYPTO_memcmp(expected.data(), parts[2].data(), expected.size()) != 0) {
    return refused("wrong job token");
  }
  uint64_t nonce_words[2] = {0, 0};
  for (int i = 0; i < 32; ++i) {
    const char c = parts[1][i];
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (digit < 0) return refused("malformed proof of the job's token");
    nonce_words[i / 16] = nonce_words[i / 16] << 4 | static_cast<uint64_t>(digit);
  }
  Nonces& nonces = process_nonces();
  absl::MutexLock lock(&nonces.mu);
  // Proofs older than the window are refused above: their nonces can go.
  const int64_t oldest_ms = absl::ToUnixMillis(now - kWindow);
  while (!nonces.seen.empty() && std::get<0>(*nonces.seen.begin()) < oldest_ms) {
    nonces.seen.erase(nonces.seen.begin());
  }
  if (ms <= nonces.floor_ms) {
    return refused("the proof of the job's token is older than every one this process still "
                   "remembers (over " + std::to_string(kMaxRemembered) +
                   " proofs in its window): make a new one");
  }
  const auto entry = std::make_tuple(ms, nonce_words[0], nonce_words[1]);
  if (nonces.seen.count(entry) > 0) return refused("a proof of the job's token was replayed");
  // At the bound, forget the oldest and refuse every proof as old as it
  // from then on; but never one that names a time still to come on this
  // clock (a client whose clock runs ahead must not push the floor past
  // the others'): then this proof is refused instead.
  if (nonces.seen.size() >= kMaxRemembered) {
    const int64_t oldest = std::get<0>(*nonces.seen.begin());
    if (oldest > absl::ToUnixMillis(now) || ms <= oldest) {
      return refused("too many proofs of the job's token in the last " +
                     absl::FormatDuration(kWindow) + " (over " + std::to_string(kMaxRemembered) +
                     "): make a new one");
    }
    nonces.floor_ms = std::max(nonces.floor_ms, oldest);
    nonces.seen.erase(nonces.seen.begin());
  }
  nonces.seen.insert(entry);
  return grpc::Status::OK;
}

std::shared_ptr<grpc::ServerCredentials> server_credentials(const Security& security) {
  if (!security.encrypted()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = security.tls_ca;
  options.pem_key_cert_pairs.push_back({security.tls_key, security.tls_cert});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> channel_credentials(const Security& security) {
  if (!security.encrypted()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = security.tls_ca;
  options.pem_private_key = security.tls_key;
  options.pem_cert_chain = security.tls_cert;
  return grpc::SslCredentials(options);
}

}  // namespace internal
}  // namespace ddprpc::rpc
