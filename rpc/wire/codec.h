// Frame codec: c10::IValue <-> wire::Value, and frames <-> grpc::ByteBuffer.
//
// A frame is [u32 header size][wire::Header][tensor bytes in header order].
// Serializing references the tensors' memory from the ByteBuffer (no copy);
// parsing copies each tensor's bytes once, straight into a new tensor.
//
// Every byte parsed here comes from a peer and is hostile until checked:
// parse_frame validates every tensor's metadata (dtype in the set that
// encode_value sends, sizes, overflow-checked element and byte counts equal
// to the bytes present) before it allocates anything, and decode_value
// checks every value (kinds, list item kinds, tensor indices used once,
// nesting depth). Malformed input gives an error, never a crash.
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

// Encodes and decodes values held in c10 capsules (e.g. RRefs), which need
// to know the peer: encoding may register the value with its owner.
class ExtensionCodec {
 public:
  virtual ~ExtensionCodec() = default;
  virtual void encode(const c10::IValue& capsule, int dest, wire::Extension* out) = 0;
  virtual c10::IValue decode(const wire::Extension& ext, int src) = 0;
};

struct CodecContext {
  ExtensionCodec* ext = nullptr;
  int peer = -1;  // destination when encoding, source when decoding
};

// Bounds on what a frame may hold, beyond its size.
inline constexpr int kMaxValueDepth = 32;            // nested tuples and lists (protobuf parses 49)
inline constexpr int kMaxTensorsPerFrame = 1 << 16;  // tensor entries of one frame
inline constexpr int kMaxTensorDims = 64;

// Whether tensors of `dtype` may cross the wire (the plain numeric types and
// bool; not quantized or undefined ones).
bool sendable_dtype(int32_t dtype);

// Encodes `value` into `out`, adding its tensors to `frame`. Throws
// rpc::TypeMismatch for values that cannot cross the wire (dicts, objects,
// sparse or quantized tensors, capsules without an ExtensionCodec, values
// nested deeper than kMaxValueDepth, ...).
void encode_value(const c10::IValue& value, wire::Value* out, Frame* frame,
                  const CodecContext& ctx = {});

// Decodes `value` using `frame`'s tensors. Throws std::invalid_argument when
// the value is malformed (bad or repeated tensor index, empty oneof, a list
// item of the wrong kind, nesting deeper than kMaxValueDepth).
c10::IValue decode_value(const wire::Value& value, const Frame& frame,
                         const CodecContext& ctx = {});

grpc::ByteBuffer serialize_frame(const Frame& frame);

// Parses bytes produced by serialize_frame. Malformed bytes give a
// non-OK status (never a crash); nothing is allocated for tensors until
// every tensor's metadata has been checked against the bytes present.
absl::Status parse_frame(const grpc::ByteBuffer& buffer, Frame* frame);
// The same, from contiguous bytes.
absl::Status parse_frame(const uint8_t* data, size_t size, Frame* frame);

}  // namespace ddprpc::rpc::internal
