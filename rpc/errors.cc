#include "rpc/errors.h"

namespace ddprpc::rpc {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk: return "OK";
    case ErrorCode::kUnknownFunction: return "UNKNOWN_FUNCTION";
    case ErrorCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case ErrorCode::kRemoteException: return "REMOTE_EXCEPTION";
    case ErrorCode::kTimeout: return "TIMEOUT";
    case ErrorCode::kUnavailable: return "UNAVAILABLE";
    case ErrorCode::kMessageTooLarge: return "MESSAGE_TOO_LARGE";
    case ErrorCode::kShutdown: return "SHUTDOWN";
    case ErrorCode::kMalformedMessage: return "MALFORMED_MESSAGE";
    case ErrorCode::kInternal: return "INTERNAL";
  }
  return "UNKNOWN";
}

}  // namespace ddprpc::rpc
