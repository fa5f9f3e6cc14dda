// Fuzzes the callee side of RPC on a decoded request, with no network: the
// first byte names the calling worker, the rest is a frame. It reaches the
// registry lookup, argument conversion, the RRef protocol's handlers and the
// hooks of distributed autograd and the profiler. Every request must be
// answered with a well-formed reply (or none, for a notice), never a crash.
#include <ATen/TensorOperators.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "autograd/dist_autograd.h"
#include "rpc/internal/callee.h"
#include "rpc/core/internal/thread_pool.h"
#include "rpc/registry.h"
#include "rpc/rref/internal/rref_context.h"
#include "rpc/wire/codec.h"

namespace {

namespace rpc = ddprpc::rpc;
using rpc::internal::Frame;

at::Tensor add(at::Tensor a, at::Tensor b) { return a + b; }
DDPRPC_REGISTER_FUNCTION(add);
c10::IValue echo(c10::IValue v) { return v; }
DDPRPC_REGISTER_FUNCTION(echo);
int64_t count(std::vector<at::Tensor> ts) { return static_cast<int64_t>(ts.size()); }
DDPRPC_REGISTER_FUNCTION(count);
std::string concat(std::string a, std::vector<std::string> b) {
  for (const auto& s : b) a += s;
  return a;
}
DDPRPC_REGISTER_FUNCTION(concat);
std::tuple<double, bool> pair(double d, bool b) { return {d, b}; }
DDPRPC_REGISTER_FUNCTION(pair);

constexpr int kWorld = 4;

// Sends replies completed outside a request; outlives every Worker.
rpc::internal::ThreadPool& reply_sender() {
  static auto* pool = new rpc::internal::ThreadPool(1);
  return *pool;
}

struct Worker {
  std::shared_ptr<rpc::internal::RRefContext> rrefs = std::make_shared<rpc::internal::RRefContext>(
      nullptr, /*self_id=*/0, kWorld, &rpc::FunctionRegistry::global());
  std::vector<rpc::internal::ExtensionCodec> codecs = {*rrefs->codec()};
  std::unique_ptr<rpc::internal::Callee> callee;
  Worker() {
    rpc::internal::Callee::Options options;
    options.self = 0;
    options.self_name = "fuzzed";
    options.max_message_bytes = 1 << 20;
    options.functions = &rpc::FunctionRegistry::global();
    options.internal_functions = {{rpc::internal::RRefContext::kFunctionPrefix, &rrefs->functions()}};
    options.extensions = &codecs;
    options.reply_sender = &reply_sender();
    callee = std::make_unique<rpc::internal::Callee>(std::move(options));
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Contexts that inputs create are dropped soon, not after 10 minutes.
  static const bool kIdleSoon = [] {
    ddprpc::dist_autograd::set_idle_context_timeout(absl::Seconds(1));
    return true;
  }();
  (void)kIdleSoon;
  if (size < 1) return 0;
  Frame request;
  if (!rpc::internal::parse_frame(data + 1, size - 1, &request).ok()) return 0;
  const auto kind = request.header.kind();
  if (kind != ddprpc::wire::REQUEST && kind != ddprpc::wire::NOTICE) return 0;  // the agent's rule for requests
  const int caller = data[0] % kWorld;
  request.header.set_src(caller);
  // Each input starts from no RRefs (what one leaves behind never expires
  // without an agent).
  Worker worker;
  worker.callee->serve(caller, request, absl::Now(), [](Frame reply) {
    Frame parsed;
    if (!rpc::internal::parse_frame(rpc::internal::serialize_frame(reply), &parsed).ok()) {
      std::fprintf(stderr, "a reply does not parse\n");
      std::abort();
    }
  });
  return 0;
}
