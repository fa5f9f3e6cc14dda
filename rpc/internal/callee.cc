#include "rpc/internal/callee.h"

#include <memory>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "rpc/hooks.h"
#include "rpc/core/internal/fault.h"
#include "rpc/core/internal/held_work.h"
#include "rpc/core/internal/thread_pool.h"
#include "rpc/worker.h"

namespace ddprpc::rpc {
namespace {

thread_local const CallContext* t_current_call = nullptr;

class CallScope {
 public:
  explicit CallScope(const CallContext* ctx) : saved_(t_current_call) { t_current_call = ctx; }
  ~CallScope() { t_current_call = saved_; }

 private:
  const CallContext* saved_;
};

}  // namespace

const CallContext* current_call() { return t_current_call; }

namespace internal {
namespace {

using HookStates = absl::InlinedVector<std::shared_ptr<void>, 2>;

ErrorCode error_code_of(std::exception_ptr error, std::string* message) {
  try {
    std::rethrow_exception(error);
  } catch (const RpcError& e) {
    *message = e.what();
    return e.code();
  } catch (const std::exception& e) {
    *message = e.what();
  } catch (...) {
    *message = "unknown exception";
  }
  return ErrorCode::kRemoteException;
}

Frame error_frame(int self, uint64_t id, ErrorCode code, const std::string& message) {
  Frame out;
  out.header.set_id(id);
  out.header.set_kind(wire::ERROR);
  out.header.set_src(self);
  out.header.set_error_code(static_cast<int>(code));
  out.header.set_error(message);
  return out;
}

}  // namespace

MessageExt read_ext(const wire::Header& header) {
  MessageExt ext;
  for (const auto& e : header.ext()) ext.append(e.key(), e.value());
  return ext;
}

void write_ext(MessageExt ext, wire::Header* header) {
  for (const auto& [key, value] : ext) {
    auto* e = header->add_ext();
    e->set_key(key);
    e->set_value(value);
  }
}

Frame Callee::error_reply(uint64_t id, ErrorCode code, const std::string& message) const {
  return error_frame(options_.self, id, code, message);
}

void Callee::serve(int caller, Frame& request, absl::Time received, const Respond& respond) {
  const wire::Header& header = request.header;
  const uint64_t id = header.id();
  const std::string function = header.function();
  const bool one_way = header.kind() == wire::NOTICE;
  auto reply_error = [&](ErrorCode code, const std::string& message) {
    if (one_way) {
      LOG(WARNING) << "rpc: one-way '" << function.substr(0, 256) << "' from worker " << caller
                   << " on worker '" << options_.self_name << "' failed: " << message;
      return;
    }
    respond(error_reply(id, code, message));
  };

  const FunctionRegistry* registry = options_.functions;
  for (const auto& [prefix, functions] : options_.internal_functions) {
    if (!prefix.empty() && absl::StartsWith(function, prefix)) {
      registry = functions;
      break;
    }
  }
  const Handler* handler = registry ? registry->find(function) : nullptr;
  if (!handler) {
    return reply_error(ErrorCode::kUnknownFunction,
                       absl::StrCat("no function named '", function.substr(0, 256),
                                    "' is registered on worker '", options_.self_name, "'"));
  }
  std::vector<c10::IValue> args;
  // Immutable and never freed (hooks.h); one state per hook, in its order.
  const RpcHooks* hooks = &rpc_hooks();
  HookStates hook_states(hooks->size());
  try {
    fault_point("agent.serve");
    c10::IValue value =
        decode_value(header.payload(), request, {options_.extensions, caller});
    if (!value.isTuple()) throw std::invalid_argument("arguments are not a tuple");
    if (!hooks->empty()) {
      const MessageExt ext = read_ext(header);
      for (size_t i = 0; i < hooks->size(); ++i) {
        hook_states[i] = (*hooks)[i]->incoming_request(caller, value, ext);
      }
    }
    args = value.toTupleRef().elements().vec();
  } catch (const RpcError& e) {
    // A hook refused the request (e.g. a bound was hit).
    return reply_error(e.code(), e.what());
  } catch (const std::exception& e) {
    return reply_error(ErrorCode::kMalformedMessage,
                       absl::StrCat("malformed arguments: ", e.what()));
  }
  request.tensors.clear();

  Future<c10::IValue> result;
  CallContext context{caller, function, received};
  {
    ++executing_;
    struct Done {
      std::atomic<int>& n;
      ~Done() { --n; }
    } done{executing_};
    // Replies the handler completes go out when it returns (after its hooks'
    // exits, before its own reply), still counted as executing.
    HeldWork held;
    CallScope scope(&context);
    try {
      HookStates hook_guards(hooks->size());
      for (size_t i = 0; i < hooks->size(); ++i) hook_guards[i] = (*hooks)[i]->enter(hook_states[i]);
      result = (*handler)(args);
    } catch (...) {
      std::string message;
      ErrorCode code = error_code_of(std::current_exception(), &message);
      return reply_error(code, message);
    }
  }
  if (one_way) return;
  const int64_t limit = options_.max_message_bytes;
  const int self = options_.self;
  const std::vector<ExtensionCodec>* const extensions = options_.extensions;
  auto reply = [respond, id, function, limit, self, caller, extensions, hooks,
                hook_states](const Future<c10::IValue>& f) {
    Frame out;
    if (std::exception_ptr error = f.error()) {
      std::string message;
      ErrorCode code = error_code_of(error, &message);
      out = error_frame(self, id, code, message);
    } else {
      out.header.set_id(id);
      out.header.set_src(self);
      out.header.set_kind(wire::RESPONSE);
      try {
        fault_point("agent.reply");
        if (!hooks->empty()) {
          MessageExt ext;
          for (size_t i = 0; i < hooks->size(); ++i) {
            (*hooks)[i]->outgoing_response(caller, hook_states[i], f.value(), &ext);
          }
          write_ext(std::move(ext), &out.header);
        }
        encode_value(f.value(), out.header.mutable_payload(), &out, {extensions, caller});
        const uint64_t size = out.size();
        if (size > static_cast<uint64_t>(limit)) {
          out = error_frame(self, id, ErrorCode::kMessageTooLarge,
                            absl::StrCat("the result of '", function, "' is ", size,
                                         " bytes, over max_message_bytes (", limit, ")"));
        }
      } catch (const std::exception& e) {
        out = error_frame(self, id, ErrorCode::kInvalidArgument,
                          absl::StrCat("the result of '", function, "' cannot be sent: ", e.what()));
      }
    }
    // Runs on threads that must not see an exception (held work, the reply
    // sender): a reply that cannot be written is logged and dropped.
    try {
      respond(std::move(out));
    } catch (const std::exception& e) {
      LOG(ERROR) << "rpc: the reply of '" << function << "' to worker " << caller
                 << " could not be sent: " << e.what();
    }
  };
  if (result.completed()) return reply(result);
  // Async execution. A thread that completes the future while serving a
  // request (for a batch, the last caller's, answering everyone) writes the
  // reply itself once that request's handler returns or waits (HeldWork):
  // completing a future then costs the handler no socket writes, and a hop
  // to another thread would cost a context switch per batch (rpc_rl, world
  // size 10, batch on: 6% fewer context switches in all). Any other thread
  // (a timer, a thread of the application) only queues it for
  // reply_sender, which encodes and writes it, so that thread is free as
  // soon as it returns.
  ThreadPool* const reply_sender = options_.reply_sender;
  result.add_done_callback([replies = replies_, reply_sender,
                            reply = std::move(reply)](const Future<c10::IValue>& f) mutable {
    if (HeldWork* held = HeldWork::current()) {
      held->add([reply = std::move(reply), f]() mutable { reply(f); });
      return;
    }
    absl::ReaderMutexLock lock(&replies->mu);
    if (replies->closed) {
      LOG(WARNING) << "rpc: an async result completed after its agent was shut down; its reply "
                      "is dropped";
      return;
    }
    if (current_call() != nullptr || reply_sender == nullptr) return reply(f);
    reply_sender->run([reply = std::move(reply), f] { reply(f); });  // runs once
  });
}

void Callee::close_replies() {
  absl::MutexLock lock(&replies_->mu);
  replies_->closed = true;
}

}  // namespace internal
}  // namespace ddprpc::rpc
