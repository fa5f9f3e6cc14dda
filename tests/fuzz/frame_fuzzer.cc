// Fuzzes what a peer's bytes reach first: parse_frame and decode_value,
// RRefs on the wire included. Any input must either be refused cleanly or
// decode into a value that encodes, serializes and parses again.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "rpc/core/errors.h"
#include "rpc/registry.h"
#include "rpc/rref/internal/rref_context.h"
#include "rpc/wire/codec.h"

namespace {

using ddprpc::rpc::FunctionRegistry;
using ddprpc::rpc::RpcError;
using ddprpc::rpc::internal::Frame;
using ddprpc::rpc::internal::RRefContext;

const FunctionRegistry& registry() {
  static auto* r = new FunctionRegistry();
  return *r;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Frame frame;
  if (!ddprpc::rpc::internal::parse_frame(data, size, &frame).ok()) return 0;
  // RRefs decode against worker 0 of a 4-worker job, with no agent; each
  // input starts from no RRefs (what one leaves behind never expires here).
  auto rrefs = std::make_shared<RRefContext>(nullptr, /*self_id=*/0, /*world_size=*/4, &registry());
  const std::vector<ddprpc::rpc::internal::ExtensionCodec> codecs = {*rrefs->codec()};
  c10::IValue value;
  try {
    value = ddprpc::rpc::internal::decode_value(frame.header.payload(), frame, {&codecs, 1});
  } catch (const std::invalid_argument&) {
    return 0;
  } catch (const RpcError&) {
    return 0;
  }
  // What was accepted can be sent on.
  Frame again;
  try {
    ddprpc::rpc::internal::encode_value(value, again.header.mutable_payload(), &again, {&codecs, 2});
  } catch (const RpcError& e) {
    // Forwarding another worker's RRef needs an agent to tell its owner.
    if (e.code() == ddprpc::rpc::ErrorCode::kShutdown) return 0;
    std::fprintf(stderr, "a decoded value does not encode: %s\n", e.what());
    std::abort();
  }
  Frame parsed;
  if (!ddprpc::rpc::internal::parse_frame(ddprpc::rpc::internal::serialize_frame(again), &parsed).ok()) {
    std::fprintf(stderr, "an encoded value does not parse\n");
    std::abort();
  }
  return 0;
}
