// Writes frames a transport read into a directory (TransportOptions::
// capture_frames_dir), e.g. to seed the fuzzers: one file per frame, named
// <kind>-<FNV-1a hash of its bytes>, holding the frame in the wire codec's
// format (what rpc/wire/codec.h's parse_frame reads).
#pragma once

#include <string>

#include <grpcpp/support/byte_buffer.h>

namespace ddprpc::rpc::internal {

// `kind`: "request" or "reply". Errors (a missing directory, a full disk)
// are ignored: capturing never fails a read.
void capture_frame(const std::string& dir, const char* kind, const grpc::ByteBuffer& frame);

}  // namespace ddprpc::rpc::internal
