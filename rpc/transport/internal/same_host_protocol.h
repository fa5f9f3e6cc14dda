// The same-host transport's messages (same_host_transport.h), shared by
// the transport and the tests that speak it by hand. Both ends run on one
// host, so fields are in the host's byte order.
//
// Every message starts with a Preamble. A connection opens with kHello
// (caller -> server: worker id, proof of the token, probe address) and
// kWelcome (server -> caller: accepted or why not, probe address, whether
// the server can read the caller's memory), then kConfirm (whether the
// caller can read the server's). Frames follow both ways: the preamble,
// the head (serialize_head), a RemoteTensor per tensor to copy from the
// sender's memory, then the other tensors' bytes in header order. A frame
// with remote tensors is answered with kAck once they are copied.
// kGoodbye says the sender is closing on purpose.
#pragma once

#include <cstdint>

namespace ddprpc::rpc::transport::same_host {

inline constexpr uint32_t kMagic = 0x43505244;  // "DRPC"
enum Kind : uint8_t { kHello = 1, kWelcome, kConfirm, kFrame, kAck, kGoodbye };
inline constexpr uint8_t kFlagMoreInFlight = 1;  // kFrame
inline constexpr uint8_t kFlagCrossMemory = 1;   // kConfirm: the caller can read the server's memory

struct Preamble {
  uint32_t magic = kMagic;
  uint8_t kind = 0;
  uint8_t flags = 0;
  uint16_t unused = 0;
  uint32_t body = 0;        // kFrame: bytes of the head; kHello, kWelcome: of the body
  uint32_t num_remote = 0;  // kFrame: tensors copied from the sender's memory
  uint64_t inline_bytes = 0;
  uint64_t remote_bytes = 0;
  uint64_t seq = 0;  // kFrame with remote tensors, and its kAck
};
static_assert(sizeof(Preamble) == 40, "Preamble layout");

struct RemoteTensor {
  uint32_t index = 0;
  uint32_t unused = 0;
  uint64_t address = 0;
};
static_assert(sizeof(RemoteTensor) == 16, "RemoteTensor layout");

struct HelloBody {
  int32_t worker = -1;
  uint32_t proof_size = 0;
  uint64_t probe = 0;
};  // followed by the proof
struct WelcomeBody {
  int32_t code = 0;  // absl::StatusCode
  uint32_t message_size = 0;
  uint64_t probe = 0;
  uint32_t cross_memory = 0;  // the server can read the caller's memory
  uint32_t unused = 0;
};  // followed by the message

}  // namespace ddprpc::rpc::transport::same_host
