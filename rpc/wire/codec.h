// The wire codec: c10::IValue <-> wire::Value, and frames <-> bytes
// (grpc::ByteBuffer, which references tensor memory without copying).
// Values are encoded by the RPC agent and callee; frames are serialized and
// parsed by the transport only.
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
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "rpc/wire/wire.pb.h"

namespace google::protobuf {
class Descriptor;
}

namespace ddprpc::rpc::internal {

struct Frame {
  wire::Header header;
  // Contiguous CPU tensors, in the order of header.tensors.
  std::vector<at::Tensor> tensors;
  // A hint of the framing, not of the RPC: the sender has other requests
  // to this peer awaiting replies. serialize_frame sends it (as the
  // header's more_in_flight), parse_frame sets it from the header.
  bool more_in_flight = false;

  // Bytes on the wire once serialized (lent tensors' bytes not counted).
  uint64_t size() const;
  // Bytes of the tensors lent on a bulk path (TensorMeta.lent).
  uint64_t lent_bytes() const;
};

// What a parse accepts beyond a plain frame.
struct ParseOptions {
  // Tensors whose bytes were lent (TensorMeta.lent): their metadata is
  // checked as any tensor's, they take no bytes of the frame, and they are
  // left undefined in Frame::tensors for the caller to allocate
  // (allocate_tensor) and fill. Without it such a frame is malformed.
  bool accept_lent = false;
};

// A new tensor for checked metadata (as parse_frame allocates one), with
// requires_grad as the metadata says (floating and complex dtypes only).
// `empty`, when given, makes the uninitialized contiguous tensor of a
// dtype and sizes instead of the CPU allocator.
using EmptyTensor = std::function<at::Tensor(c10::ScalarType, c10::IntArrayRef)>;
at::Tensor allocate_tensor(const wire::TensorMeta& meta, const EmptyTensor& empty = nullptr);

// How values held in c10 capsules (e.g. RRefs) cross the wire, given by
// the layer that defines them. Both ends need the peer: encoding may
// register the value with its owner. Several codecs may serve one frame,
// each for its own values.
struct ExtensionCodec {
  std::string type;  // wire::Extension.type of its values
  // Whether `capsule` is one of its values.
  std::function<bool(const c10::IValue& capsule)> claims_capsule;
  std::function<void(const c10::IValue& capsule, int dest, wire::Extension* out)> encode_capsule;
  // Throws std::invalid_argument for a malformed value.
  std::function<c10::IValue(const wire::Extension& ext, int src)> decode_capsule;
};

struct CodecContext {
  const std::vector<ExtensionCodec>* extensions = nullptr;  // none: capsules are refused
  int peer = -1;  // destination when encoding, source when decoding
};

// Bounds on what a frame may hold, beyond its size.
inline constexpr int kMaxValueDepth = 32;            // nested tuples and lists (protobuf parses 49)
inline constexpr int kMaxTensorsPerFrame = 1 << 16;  // tensor entries of one frame
inline constexpr int kMaxTensorDims = 64;
// Fields a frame's header may hold, counting each value, tensor entry,
// extension entry and scalar field, and each element of a packed list (a
// tensor's sizes): a receiver counts them in a header of over 64 KiB
// before protobuf parses it, so that a header's bytes cannot turn into
// many times as many in memory. encode_value refuses a value that would
// take its frame past it.
inline constexpr int64_t kMaxHeaderFields = 1 << 22;

// The fields of a `type` message encoded in `bytes`, counted as
// kMaxHeaderFields counts a header's, without parsing it: for another
// message a peer sends inside a frame (e.g. an extension's bytes). -1 when
// the bytes are malformed or hold more than `limit`.
int64_t count_message_fields(absl::string_view bytes, const google::protobuf::Descriptor* type,
                             int64_t limit);

// Whether tensors of `dtype` may cross the wire (the plain numeric types and
// bool; not quantized or undefined ones).
bool sendable_dtype(int32_t dtype);

// Encodes `value` into `out`, adding its tensors to `frame`. Throws
// rpc::TypeMismatch for values that cannot cross the wire (dicts, objects,
// sparse or quantized tensors, capsules without an ExtensionCodec, values
// nested deeper than kMaxValueDepth, a header past kMaxHeaderFields, ...).
void encode_value(const c10::IValue& value, wire::Value* out, Frame* frame,
                  const CodecContext& ctx = {});

// Decodes `value` using `frame`'s tensors. Throws std::invalid_argument when
// the value is malformed (bad or repeated tensor index, empty oneof, a list
// item of the wrong kind, nesting deeper than kMaxValueDepth).
c10::IValue decode_value(const wire::Value& value, const Frame& frame,
                         const CodecContext& ctx = {});

// The bytes of lent tensors (TensorMeta.lent set) are left out.
grpc::ByteBuffer serialize_frame(const Frame& frame);

// Parses bytes produced by serialize_frame. Malformed bytes give a
// non-OK status (never a crash); nothing is allocated for tensors until
// every tensor's metadata has been checked against the bytes present.
absl::Status parse_frame(const grpc::ByteBuffer& buffer, Frame* frame,
                         const ParseOptions& options = {});
// The same, from contiguous bytes.
absl::Status parse_frame(const uint8_t* data, size_t size, Frame* frame,
                         const ParseOptions& options = {});

// The head of a serialized frame: its size prefix and header, without the
// tensor bytes (which follow it in header order).
std::string serialize_head(const Frame& frame);

// Writes the `nbytes` bytes of tensor `index` into `dst`; a non-OK status
// ends the parse with it.
using TensorFiller = std::function<absl::Status(int index, void* dst, uint64_t nbytes)>;
// Parses a frame delivered in two parts: `head`, as serialize_head wrote
// it, and tensor bytes (`tensor_bytes` in all, as the sender claims) that
// `fill` writes straight into each new tensor. The head is checked as
// parse_frame checks it, and the tensors' byte counts must add up to
// `tensor_bytes`, before any tensor is allocated.
absl::Status parse_frame(absl::string_view head, uint64_t tensor_bytes, const TensorFiller& fill,
                         Frame* frame);

}  // namespace ddprpc::rpc::internal
