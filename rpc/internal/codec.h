// Frame codec: c10::IValue <-> wire::Value, and frames <-> grpc::ByteBuffer.
//
// A frame is [u32 header size][wire::Header][tensor bytes in header order].
// Serializing references the tensors' memory from the ByteBuffer (no copy);
// parsing copies each tensor's bytes once, straight into a new tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <grpcpp/support/byte_buffer.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "rpc/wire.pb.h"

namespace ddprpc::rpc::internal {

struct Frame {
  wire::Header header;
  // Contiguous CPU tensors, in the order of header.tensors.
  std::vector<at::Tensor> tensors;

  // Bytes on the wire once serialized.
  uint64_t size() const;
};

// Encodes `value` into `out`, adding its tensors to `frame`. Throws
// rpc::TypeMismatch for values that cannot cross the wire (dicts, objects,
// sparse tensors, ...).
void encode_value(const c10::IValue& value, wire::Value* out, Frame* frame);

// Decodes `value` using `frame`'s tensors. Throws std::invalid_argument when
// the value is malformed (bad tensor index, empty oneof).
c10::IValue decode_value(const wire::Value& value, const Frame& frame);

grpc::ByteBuffer serialize_frame(const Frame& frame);

// Parses bytes produced by serialize_frame. Malformed bytes give a
// non-OK status (never a crash).
absl::Status parse_frame(const grpc::ByteBuffer& buffer, Frame* frame);

}  // namespace ddprpc::rpc::internal
