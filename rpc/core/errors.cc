#include "rpc/core/errors.h"

#include <string>

#include "glog/logging.h"

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
    case ErrorCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case ErrorCode::kPermissionDenied: return "PERMISSION_DENIED";
  }
  return "UNKNOWN";
}

bool valid_error_code(int code) {
  return code > static_cast<int>(ErrorCode::kOk) &&
         code <= static_cast<int>(ErrorCode::kPermissionDenied);
}

namespace internal {

void report_callback_error(std::exception_ptr error) noexcept {
  std::string message = "unknown exception";
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
  }
  LOG(ERROR) << "rpc::Future: a done callback threw (ignored): " << message;
}

}  // namespace internal

}  // namespace ddprpc::rpc
