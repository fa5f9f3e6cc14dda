// Proof of the job's secret on a connection (see rpc/security.h), and the
// gRPC credentials of the job's TLS material.
#pragma once

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/support/status.h>
#include <grpcpp/support/string_ref.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/core/security.h"

namespace ddprpc::rpc::internal {

// Initial metadata carrying the proof: "<unix ms>.<nonce>.<mac>", the mac
// being HMAC-SHA256(token, "ddprpc/2|client-to-server|<purpose>|<transport>|
// <from>|<to>|<unix ms>|<nonce>").
inline constexpr char kAuthMetadataKey[] = "ddprpc-auth";

// What a proof opens, all of it signed: a proof made for one server,
// transport or purpose is refused by every other.
struct ProofScope {
  std::string purpose;    // "rpc" or "store"
  std::string transport;  // "grpc" or "same-host"
  int from = -1;          // the worker that opens it (-1: none)
  int to = -1;            // the worker it is opened to (-1: the store, or a server that has no id)
};

// The proof that a client opening `scope` knows `token`.
std::string auth_proof(const std::string& token, const ProofScope& scope);

// HMAC-SHA256 (64 hex digits) of "ddprpc/2|member|<message>" under `token`:
// what two of the job's processes show each other over a channel of their
// own (a collective's pairs). Never equal to a proof of auth_proof.
std::string member_mac(const std::string& token, absl::string_view message);

// Checks proofs against one token. Thread-safe.
class AuthChecker {
 public:
  // Proofs older or newer than this (clock skew) are refused.
  static constexpr absl::Duration kWindow = absl::Minutes(5);
  // Nonces remembered (each proof is accepted once), for the whole
  // process: every checker (each server of every transport, the store)
  // shares one set, so a proof accepted by one is refused by all. When more
  // proofs than this arrive within the window, the oldest are forgotten and
  // every proof naming a time no later than theirs is refused from then on
  // (a fresh proof still gets in), so that none of them can be replayed. A
  // proof naming a time still to come on this clock is never forgotten: a
  // new proof is refused instead.
  static constexpr size_t kMaxRemembered = 1 << 20;

  explicit AuthChecker(std::string token) : token_(std::move(token)) {}
  // OK, or UNAUTHENTICATED saying what was wrong (never the token).
  grpc::Status check(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                     const ProofScope& scope);
  // The same for a proof given directly (auth_proof's string).
  grpc::Status check_proof(absl::string_view proof, const ProofScope& scope);

 private:
  const std::string token_;
};

// Credentials for the job's channels and servers: mutual TLS when
// `security` has TLS material, else insecure.
std::shared_ptr<grpc::ServerCredentials> server_credentials(const Security& security);
std::shared_ptr<grpc::ChannelCredentials> channel_credentials(const Security& security);

}  // namespace ddprpc::rpc::internal
