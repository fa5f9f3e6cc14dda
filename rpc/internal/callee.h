// The callee side of an RPC: one request frame in, at most one reply frame
// out. It looks the function up (user functions, or the internal ones of an
// extension such as RRefs), decodes and checks the arguments, runs the hooks
// and the function, and encodes the result or the error. Which thread reads
// requests and how replies travel is the agent's business; the callee only
// calls `respond` with the reply frame.
//
// Nothing a request contains escapes as an exception: every failure becomes
// an error reply naming the function and this worker.
#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/core/errors.h"
#include "rpc/registry.h"
#include "rpc/wire/codec.h"

namespace ddprpc::rpc {
class MessageExt;
}

namespace ddprpc::rpc::internal {

class ThreadPool;

// A header's key/value pairs for the hooks, and back.
MessageExt read_ext(const wire::Header& header);
void write_ext(MessageExt ext, wire::Header* header);

class Callee {
 public:
  struct Options {
    int self = 0;
    std::string self_name;
    int64_t max_message_bytes = int64_t{1} << 31;
    const FunctionRegistry* functions = nullptr;  // user functions
    // Internal functions of extensions, by name prefix (e.g. "__rref.").
    std::vector<std::pair<std::string, const FunctionRegistry*>> internal_functions;
    // Decode and encode the extensions' values.
    const std::vector<ExtensionCodec>* extensions = nullptr;
    // Sends the replies of async results completed outside any request.
    ThreadPool* reply_sender = nullptr;
  };
  using Respond = std::function<void(Frame reply)>;

  explicit Callee(Options options) : options_(std::move(options)) {}

  // Serves `request`, which arrived at `received` on the stream of worker
  // `caller`. Returns once the function has returned; `respond` is called at
  // most once (never for a notice), now or when an async result completes.
  void serve(int caller, Frame& request, absl::Time received, const Respond& respond);

  // The reply that fails request `id` with `code`.
  Frame error_reply(uint64_t id, ErrorCode code, const std::string& message) const;

  // Requests whose function is running right now.
  int executing() const { return executing_.load(); }

  // From now on, async results that complete (a future the program still
  // holds after its agent is gone) are dropped, not answered: what their
  // replies would use (the reply sender, the codecs, the transport) is
  // going away. Waits for replies being dispatched now.
  void close_replies();

 private:
  struct Replies {
    absl::Mutex mu;
    bool closed ABSL_GUARDED_BY(mu) = false;
  };
  const Options options_;
  std::atomic<int> executing_{0};
  const std::shared_ptr<Replies> replies_ = std::make_shared<Replies>();
};

}  // namespace ddprpc::rpc::internal
