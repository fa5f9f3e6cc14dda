// Error type of the RPC runtime. Every failed call surfaces as an RpcError
// whose message names the worker and the function involved.
#pragma once

#include <stdexcept>
#include <string>

namespace ddprpc::rpc {

enum class ErrorCode : int {
  kOk = 0,
  kUnknownFunction = 1,   // the callee has no function of that name
  kInvalidArgument = 2,   // wrong argument count or types, unsupported value
  kRemoteException = 3,   // the callee's function threw
  kTimeout = 4,           // no response before the call's deadline
  kUnavailable = 5,       // peer unreachable, dead, or its stream broke
  kMessageTooLarge = 6,   // message above RpcBackendOptions::max_message_bytes
  kShutdown = 7,          // RPC not initialized or already shut down
  kMalformedMessage = 8,  // bytes that do not decode as a frame
  kInternal = 9,
  kResourceExhausted = 10,  // a bound of the callee was hit (queued requests, RRefs, ...)
  kPermissionDenied = 11,   // the caller may not do this (e.g. delete another worker's RRef)
};

// Whether `code` names an ErrorCode (for codes read off the wire).
bool valid_error_code(int code);

const char* error_code_name(ErrorCode code);

class RpcError : public std::runtime_error {
 public:
  RpcError(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace ddprpc::rpc
