// Who may connect: the job's secret and its TLS material.
//
// Every connection to a worker (RPC streams) or to the rendezvous store
// proves that it belongs to the job before anything it sends is parsed: its
// metadata carries HMAC-SHA256(token, what it opens, its worker, a time and
// a nonce), checked in constant time, within a time window, each nonce once.
// The token itself never crosses the network. With TLS (optional, mutual:
// every end shows a certificate from the job's CA), streams are encrypted
// and their peers' certificates verified; without it, traffic is
// authenticated at connection set-up but not encrypted.
//
//   rpc::Security s = rpc::Security::from_environment();   // DDPRPC_AUTH_TOKEN, ...
#pragma once

#include <memory>
#include <string>

namespace grpc {
class ChannelCredentials;
class ServerCredentials;
}  // namespace grpc

namespace ddprpc::rpc {

struct Security {
  // The job's secret (any bytes; empty: connections are not authenticated).
  std::string token;
  // PEM contents (not paths). With all three set, every gRPC channel and
  // server of the job uses mutual TLS with them.
  std::string tls_cert;  // this process's certificate chain
  std::string tls_key;   // its private key
  std::string tls_ca;    // the CA that signed every certificate of the job

  bool authenticated() const { return !token.empty(); }
  bool encrypted() const { return !tls_cert.empty(); }

  // From the environment: DDPRPC_AUTH_TOKEN, or the file named by
  // DDPRPC_AUTH_TOKEN_FILE (trailing newlines dropped); DDPRPC_TLS_CERT,
  // DDPRPC_TLS_KEY and DDPRPC_TLS_CA name PEM files. Throws RpcError
  // (kInvalidArgument) for a file it cannot read or an incomplete TLS set.
  static Security from_environment();
  // Fills what `this` leaves empty from the environment.
  Security with_environment_defaults() const;

  // A new random token (32 bytes, hex), e.g. for a launcher's children.
  static std::string random_token();
};

// Environment variable names.
inline constexpr char kAuthTokenEnv[] = "DDPRPC_AUTH_TOKEN";
inline constexpr char kAuthTokenFileEnv[] = "DDPRPC_AUTH_TOKEN_FILE";
inline constexpr char kTlsCertEnv[] = "DDPRPC_TLS_CERT";
inline constexpr char kTlsKeyEnv[] = "DDPRPC_TLS_KEY";
inline constexpr char kTlsCaEnv[] = "DDPRPC_TLS_CA";

}  // namespace ddprpc::rpc
