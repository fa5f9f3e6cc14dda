#include "rpc/profiler/profiler.h"

#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <limits>
#include <set>
#include <tuple>
#include <stdexcept>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "rpc/hooks.h"
#include "rpc/profiler/profiler.pb.h"
#include "rpc/rpc.h"
#include "rpc/wire/codec.h"

namespace ddprpc::rpc::profiler {

// Events of one Profile, of one profiled request on its callee, or of a
// ServerProfile. Times are ns since `origin_ns` (the Profile's start; the
// callee's receipt of the request); node -1 means "the worker that owns
// this recorder". A request recorded for both its caller and a
// ServerProfile passes each event on to the latter (`also`).
class Recorder {
 public:
  Recorder(int64_t origin_ns, ProfileOptions options, std::shared_ptr<Recorder> also = nullptr)
      : origin_ns(origin_ns), options(options), also(std::move(also)) {}
  const int64_t origin_ns;
  const ProfileOptions options;
  const std::shared_ptr<Recorder> also;

  void add(Event event) {
    if (also) {
      Event copy = event;
      copy.start_ns += origin_ns - also->origin_ns;
      also->add(std::move(copy));
    }
    absl::MutexLock lock(&mu_);
    if (!closed_) events_.push_back(std::move(event));
  }
  void add_all(std::vector<Event> events, const std::map<int, std::string>& names) {
    if (also) {
      std::vector<Event> copies = events;
      for (Event& e : copies) e.start_ns += origin_ns - also->origin_ns;
      also->add_all(std::move(copies), names);
    }
    absl::MutexLock lock(&mu_);
    if (closed_) return;
    for (auto& e : events) events_.push_back(std::move(e));
    for (const auto& [id, name] : names) names_.emplace(id, name);
  }
  // `self` is the worker that owns this recorder.
  void note_workers(const WorkerInfo& self, const WorkerInfo& other) {
    if (also) also->note_workers(self, other);
    absl::MutexLock lock(&mu_);
    if (self_node_ < 0) self_node_ = self.id;
    names_.emplace(self.id, self.name);
    names_.emplace(other.id, other.name);
  }
  // Stops accepting events.
  void close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  std::vector<Event> events() const {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  std::map<int, std::string> names() const {
    absl::MutexLock lock(&mu_);
    return names_;
  }
  int self_node() const {
    absl::MutexLock lock(&mu_);
    return self_node_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<Event> events_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::string> names_ ABSL_GUARDED_BY(mu_);
  int self_node_ ABSL_GUARDED_BY(mu_) = -1;  // from the first RPC recorded
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

namespace {

constexpr char kProfileKey[] = "profiler.on";
constexpr char kEventsKey[] = "profiler.events";

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t thread_index() {
  static std::atomic<int64_t> next{0};
  thread_local const int64_t index = next.fetch_add(1);
  return index;
}

// Threads with a recorder pushed, process-wide: the hot path's only check.
std::atomic<int> g_recording_threads{0};

// An operator that started on this thread and has not ended.
struct OpContext : at::ObserverContext {
  std::shared_ptr<Recorder> recorder;
  int64_t start_ns = 0;
  int64_t children_ns = 0;
  int64_t self_bytes = 0;      // allocated minus freed by this operator itself
  int64_t children_bytes = 0;  // by its child operators
  std::vector<std::vector<int64_t>> input_shapes;
  OpContext* parent = nullptr;
};

struct ThreadState {
  std::shared_ptr<Recorder> top;  // where this thread's events go
  int depth = 0;                  // recorders pushed
  at::CallbackHandle callback = at::INVALID_CALLBACK_HANDLE;
  bool callback_inputs = false;  // the callback asks for operators' inputs
  bool memory_reporting = false;  // a MemoryReporter is pushed on this thread
  OpContext* open = nullptr;      // innermost running operator
};
thread_local ThreadState t_state;

// Told by libtorch's CPU allocator of each allocation and free on a thread
// where it is pushed (as c10's profiler state); charges the bytes to the
// innermost running operator.
class MemoryReporter : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void* ptr, int64_t alloc_size, size_t total_allocated,
                         size_t total_reserved, c10::Device device) override {
    OpContext* op = t_state.open;
    if (op && op->recorder->options.profile_memory) op->self_bytes += alloc_size;
  }
  bool memoryProfilingEnabled() const override { return true; }
};

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  ThreadState& ts = t_state;
  if (!ts.top) return nullptr;
  auto ctx = std::make_unique<OpContext>();
  ctx->recorder = ts.top;
  if (ctx->recorder->options.record_shapes) {
    for (const c10::IValue& input : fn.inputs()) {
      if (input.isTensor() && input.toTensor().defined()) {
        ctx->input_shapes.push_back(input.toTensor().sizes().vec());
      } else {
        ctx->input_shapes.emplace_back();
      }
    }
  }
  ctx->parent = ts.open;
  ts.open = ctx.get();
  ctx->start_ns = now_ns();
  return ctx;
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext* base) {
  const int64_t end = now_ns();
  auto* ctx = static_cast<OpContext*>(base);
  if (!ctx) return;
  ThreadState& ts = t_state;
  const int64_t duration = end - ctx->start_ns;
  const int64_t bytes = ctx->self_bytes + ctx->children_bytes;
  if (ts.open == ctx) {
    ts.open = ctx->parent;
    if (ctx->parent) {
      ctx->parent->children_ns += duration;
      ctx->parent->children_bytes += bytes;
    }
  } else {
    // Ended out of order: unlink it so no one points at it any more.
    for (OpContext* c = ts.open; c; c = c->parent) {
      if (c->parent == ctx) {
        c->parent = ctx->parent;
        break;
      }
    }
  }
  Event event;
  event.name = fn.name();
  event.thread = thread_index();
  event.start_ns = ctx->start_ns - ctx->recorder->origin_ns;
  event.duration_ns = duration;
  event.self_ns = std::max<int64_t>(0, duration - ctx->children_ns);
  event.input_shapes = std::move(ctx->input_shapes);
  event.cpu_memory_usage = bytes;
  event.self_cpu_memory_usage = ctx->self_bytes;
  ctx->recorder->add(std::move(event));
}

void add_callback(ThreadState& ts, bool inputs) {
  ts.callback = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&on_op_start, &on_op_end)
          .needsInputs(inputs)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                   at::RecordScope::TORCHSCRIPT_FUNCTION, at::RecordScope::USER_SCOPE}));
  ts.callback_inputs = inputs;
}

// Makes `recorder` this thread's destination; returns the one it shadows.
std::shared_ptr<Recorder> push(std::shared_ptr<Recorder> recorder) {
  ThreadState& ts = t_state;
  const ProfileOptions options = recorder->options;
  std::shared_ptr<Recorder> previous = std::move(ts.top);
  ts.top = std::move(recorder);
  if (ts.depth++ == 0) {
    add_callback(ts, options.record_shapes);
    g_recording_threads.fetch_add(1, std::memory_order_relaxed);
  } else if (options.record_shapes && !ts.callback_inputs) {
    at::removeCallback(ts.callback);
    add_callback(ts, true);
  }
  if (options.profile_memory && !ts.memory_reporting) {
    c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE,
                                     std::make_shared<MemoryReporter>());
    ts.memory_reporting = true;
  }
  return previous;
}

void pop(std::shared_ptr<Recorder> previous) {
  ThreadState& ts = t_state;
  ts.top = std::move(previous);
  if (--ts.depth == 0) {
    at::removeCallback(ts.callback);
    ts.callback = at::INVALID_CALLBACK_HANDLE;
    ts.callback_inputs = false;
    ts.open = nullptr;
    if (ts.memory_reporting) {
      ts.memory_reporting = false;
      try {
        c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
      } catch (const std::exception& e) {
        LOG(ERROR) << "profiler: the memory reporter was not on top of this thread's debug info: "
                   << e.what();
      }
    }
    g_recording_threads.fetch_sub(1, std::memory_order_relaxed);
  }
}

// The running ServerProfile's recorder; g_server_on is the hot path's check.
std::atomic<bool> g_server_on{false};
absl::Mutex g_server_mu;
std::shared_ptr<Recorder>& server_slot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_server_mu) {
  static auto* slot = new std::shared_ptr<Recorder>();
  return *slot;
}
std::shared_ptr<Recorder> server_recorder() {
  if (!g_server_on.load(std::memory_order_relaxed)) return nullptr;
  absl::MutexLock lock(&g_server_mu);
  return server_slot();
}

// What a caller asks its callee to record, in the request's ext.
std::string profile_flags(const ProfileOptions& options) {
  return absl::StrCat("1", options.record_shapes ? "s" : "", options.profile_memory ? "m" : "");
}
ProfileOptions parse_flags(const std::string& flags) {
  ProfileOptions options;
  options.record_shapes = flags.find('s') != std::string::npos;
  options.profile_memory = flags.find('m') != std::string::npos;
  return options;
}

// Caller side of one profiled call.
struct CallState {
  std::shared_ptr<Recorder> recorder;
  std::string name;
  int from = -1;
  int to = -1;
  int64_t thread = 0;
  int64_t start_ns = 0;  // absolute
};

// Callee side of one request recorded for its caller, a ServerProfile or both.
struct RequestState {
  bool for_caller = false;
  ProfileOptions caller_options;
  std::shared_ptr<Recorder> server;    // the ServerProfile running at arrival
  std::shared_ptr<Recorder> recorder;  // for the caller; created when the function starts
  bool entered = false;
  int64_t origin_ns = 0;  // arrival
  int64_t thread = 0;
  std::string name;  // "rpc_request#function(caller -> callee)"
};

class ProfilerHook : public RpcHook {
 public:
  // Fields of the events a callee ships back with one reply.
  static constexpr int64_t kMaxShippedFields = 1 << 20;

  std::shared_ptr<void> start_call(const OutgoingCall& call, MessageExt* ext) override {
    if (g_recording_threads.load(std::memory_order_relaxed) == 0) return nullptr;
    const std::shared_ptr<Recorder>& recorder = t_state.top;
    if (!recorder) return nullptr;
    recorder->note_workers(call.from, call.to);
    auto state = std::make_shared<CallState>();
    state->recorder = recorder;
    state->name = absl::StrCat(call.api, "#", call.display, "(", call.from.name, " -> ",
                               call.to.name, ")");
    state->from = call.from.id;
    state->to = call.to.id;
    state->thread = thread_index();
    (*ext)[kProfileKey] = profile_flags(recorder->options);
    state->start_ns = now_ns();
    return state;
  }

  void end_call(const std::shared_ptr<void>& opaque, const MessageExt* reply) override {
    const int64_t end = now_ns();
    auto* state = static_cast<CallState*>(opaque.get());
    Recorder& recorder = *state->recorder;
    Event rpc;
    rpc.name = state->name;
    rpc.node = state->from;
    rpc.thread = state->thread;
    rpc.start_ns = state->start_ns - recorder.origin_ns;
    rpc.duration_ns = end - state->start_ns;
    rpc.rpc = true;
    recorder.add(rpc);
    if (!reply) return;
    auto it = reply->find(kEventsKey);
    if (it == reply->end()) return;
    // Counted before parsing: empty events take two bytes each on the wire
    // and a hundred times that once parsed.
    const int64_t fields = internal::count_message_fields(
        it->second, ::ddprpc::profiling::ProfiledRequest::descriptor(), kMaxShippedFields);
    ::ddprpc::profiling::ProfiledRequest shipped;
    if (fields < 0 || !shipped.ParseFromString(it->second)) {
      LOG(WARNING) << "profiler: remote events in the reply to " << state->name
                   << (fields < 0 ? " are malformed or hold more than " +
                                        std::to_string(kMaxShippedFields) + " fields"
                                  : std::string(" are malformed"))
                   << "; dropped";
      return;
    }
    // The callee's clock is unknown: center its span in the round trip.
    const int64_t slack = std::max<int64_t>(0, rpc.duration_ns - shipped.duration_ns());
    const int64_t shift = rpc.start_ns + slack / 2;
    std::vector<Event> events;
    events.reserve(shipped.events_size());
    const std::string prefix = state->name + "#remote_op: ";
    for (const auto& e : shipped.events()) {
      Event event;
      event.name = prefix + e.name();
      event.node = e.node() < 0 ? state->to : e.node();
      event.thread = e.thread();
      event.start_ns = shift + e.start_ns();
      event.duration_ns = e.duration_ns();
      event.self_ns = e.self_ns();
      event.rpc = e.rpc();
      event.input_shapes.reserve(e.input_shapes_size());
      for (const auto& shape : e.input_shapes()) {
        event.input_shapes.emplace_back(shape.dims().begin(), shape.dims().end());
      }
      event.cpu_memory_usage = e.cpu_memory_usage();
      event.self_cpu_memory_usage = e.self_cpu_memory_usage();
      events.push_back(std::move(event));
    }
    recorder.add_all(std::move(events), {shipped.node_names().begin(), shipped.node_names().end()});
  }

  std::shared_ptr<void> incoming_request(int src, const c10::IValue& args,
                                         const MessageExt& ext) override {
    auto flags = ext.find(kProfileKey);
    std::shared_ptr<Recorder> server = server_recorder();
    if (flags == ext.end() && !server) return nullptr;
    auto state = std::make_shared<RequestState>();
    state->for_caller = flags != ext.end();
    if (state->for_caller) state->caller_options = parse_flags(flags->second);
    state->server = std::move(server);
    return state;
  }

  std::shared_ptr<void> enter(const std::shared_ptr<void>& opaque) override {
    if (!opaque) return nullptr;
    auto* request = static_cast<RequestState*>(opaque.get());
    // Times count from the request's arrival, so time spent waiting for a
    // worker thread is part of the callee's span (and not of the network's).
    int64_t origin = now_ns();
    const CallContext* call = current_call();
    if (call) origin -= std::max<int64_t>(0, absl::ToInt64Nanoseconds(absl::Now() - call->received));
    request->entered = true;
    request->origin_ns = origin;
    request->thread = thread_index();
    std::shared_ptr<Recorder> destination;
    if (request->for_caller) {
      ProfileOptions options = request->caller_options;
      if (request->server) {
        options.record_shapes |= request->server->options.record_shapes;
        options.profile_memory |= request->server->options.profile_memory;
      }
      request->recorder = std::make_shared<Recorder>(origin, options, request->server);
      destination = request->recorder;
    } else {
      destination = request->server;
    }
    if (request->server && call) {
      try {
        std::shared_ptr<RpcAgent> agent = current_agent();
        const WorkerInfo& caller = agent->worker(call->caller);
        request->server->note_workers(agent->self(), caller);
        request->name = absl::StrCat("rpc_request#", call->function, "(", caller.name, " -> ",
                                     agent->self().name, ")");
      } catch (const std::exception&) {
        request->name = absl::StrCat("rpc_request#", call->function);
      }
    }
    struct Guard {
      std::shared_ptr<Recorder> previous;
      ~Guard() { pop(std::move(previous)); }
    };
    auto guard = std::make_shared<Guard>();
    guard->previous = push(std::move(destination));
    return guard;
  }

  void outgoing_response(int dest, const std::shared_ptr<void>& opaque, const c10::IValue& result,
                         MessageExt* ext) override {
    if (!opaque) return;
    auto* request = static_cast<RequestState*>(opaque.get());
    if (!request->entered) return;  // the function never ran
    const int64_t end = now_ns();
    if (request->server && !request->name.empty()) {
      Event span;
      span.name = request->name;
      span.thread = request->thread;
      span.start_ns = request->origin_ns - request->server->origin_ns;
      span.duration_ns = end - request->origin_ns;
      span.rpc = true;
      request->server->add(std::move(span));
    }
    if (!request->recorder) return;
    Recorder& recorder = *request->recorder;
    recorder.close();
    ::ddprpc::profiling::ProfiledRequest shipped;
    shipped.set_duration_ns(end - recorder.origin_ns);
    for (const Event& e : recorder.events()) {
      ::ddprpc::profiling::ProfiledEvent* out = shipped.add_events();
      out->set_name(e.name);
      out->set_node(e.node);
      out->set_thread(e.thread);
      out->set_start_ns(e.start_ns);
      out->set_duration_ns(e.duration_ns);
      out->set_self_ns(e.self_ns);
      out->set_rpc(e.rpc);
      for (const auto& shape : e.input_shapes) {
        out->add_input_shapes()->mutable_dims()->Add(shape.begin(), shape.end());
      }
      out->set_cpu_memory_usage(e.cpu_memory_usage);
      out->set_self_cpu_memory_usage(e.self_cpu_memory_usage);
    }
    for (const auto& [id, name] : recorder.names()) (*shipped.mutable_node_names())[id] = name;
    // What a caller takes (kMaxShippedFields): past it, the first events go.
    std::string bytes = shipped.SerializeAsString();
    const auto* type = ::ddprpc::profiling::ProfiledRequest::descriptor();
    int64_t fields = internal::count_message_fields(bytes, type, std::numeric_limits<int64_t>::max());
    const int recorded = shipped.events_size();
    while (fields > kMaxShippedFields && shipped.events_size() > 0) {
      const int keep = static_cast<int>(static_cast<double>(shipped.events_size()) *
                                        (0.9 * kMaxShippedFields / static_cast<double>(fields)));
      shipped.mutable_events()->DeleteSubrange(keep, shipped.events_size() - keep);
      bytes = shipped.SerializeAsString();
      fields = internal::count_message_fields(bytes, type, std::numeric_limits<int64_t>::max());
    }
    if (shipped.events_size() < recorded) {
      LOG(WARNING) << "profiler: the reply to " << request->name << " carries the first "
                   << shipped.events_size() << " of its " << recorded << " events (at most "
                   << kMaxShippedFields << " fields of events per reply)";
    }
    (*ext)[kEventsKey] = std::move(bytes);
  }
};

const bool kHookInstalled = [] {
  add_rpc_hook(std::make_shared<ProfilerHook>());
  return true;
}();

std::string format_time(double ns) {
  const double us = ns / 1000.0;
  if (us >= 1e6) return absl::StrFormat("%.3fs", us / 1e6);
  if (us >= 1e3) return absl::StrFormat("%.3fms", us / 1e3);
  return absl::StrFormat("%.3fus", us);
}

std::string format_share(double part, double total) {
  if (total == 0) return "NaN";
  return absl::StrFormat("%.2f%%", part * 100.0 / total);
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", static_cast<int>(c));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string json_us(int64_t ns) { return absl::StrFormat("%.3f", ns / 1000.0); }

// As PyTorch's table prints memory.
std::string format_memory(int64_t bytes) {
  constexpr double kKb = 1024.0, kMb = kKb * 1024, kGb = kMb * 1024;
  const double b = static_cast<double>(bytes);
  const double magnitude = b < 0 ? -b : b;
  if (magnitude >= kGb) return absl::StrFormat("%.2f Gb", b / kGb);
  if (magnitude >= kMb) return absl::StrFormat("%.2f Mb", b / kMb);
  if (magnitude >= kKb) return absl::StrFormat("%.2f Kb", b / kKb);
  return absl::StrCat(bytes, " b");
}

std::string shapes_string(const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<std::string> parts;
  parts.reserve(shapes.size());
  for (const auto& shape : shapes) parts.push_back(absl::StrCat("[", absl::StrJoin(shape, ", "), "]"));
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

}  // namespace

bool is_profiling() { return t_state.top != nullptr; }

// ------------------------------------------------------------------ results

std::vector<Event> ProfileResult::events() const {
  std::vector<Event> events = recorder_->events();
  int self = recorder_->self_node();
  if (self < 0) {
    try {
      self = current_agent()->self().id;
    } catch (const std::exception&) {
      self = 0;
    }
  }
  for (Event& e : events) {
    if (e.node < 0) e.node = self;
  }
  std::stable_sort(events.begin(), events.end(),
                   [](const Event& a, const Event& b) { return a.start_ns < b.start_ns; });
  return events;
}

std::map<int, std::string> ProfileResult::node_names() const { return recorder_->names(); }

KeyAverages ProfileResult::key_averages(bool group_by_input_shape) const {
  std::vector<EventStats> rows;
  std::map<std::tuple<std::string, int, std::string>, size_t> index;
  for (const Event& e : events()) {
    std::string shapes = group_by_input_shape ? shapes_string(e.input_shapes) : "";
    auto [it, inserted] = index.emplace(std::make_tuple(e.name, e.node, shapes), rows.size());
    if (inserted) {
      EventStats stats;
      stats.name = e.name;
      stats.node = e.node;
      stats.rpc = e.rpc;
      stats.input_shapes = std::move(shapes);
      rows.push_back(std::move(stats));
    }
    EventStats& row = rows[it->second];
    ++row.count;
    row.self_ns += e.self_ns;
    row.total_ns += e.duration_ns;
    row.cpu_memory_usage += e.cpu_memory_usage;
    row.self_cpu_memory_usage += e.self_cpu_memory_usage;
  }
  return KeyAverages(std::move(rows), recorder_->options.profile_memory, group_by_input_shape);
}

// ------------------------------------------------------------------ Profile

Profile::Profile(ProfileOptions options)
    : ProfileResult(std::make_shared<Recorder>(now_ns(), options)),
      thread_(std::this_thread::get_id()) {
  (void)kHookInstalled;
  shadowed_ = push(recorder_);
}

Profile::~Profile() {
  if (stopped_) return;
  if (std::this_thread::get_id() != thread_) {
    LOG(ERROR) << "rpc::profiler::Profile destroyed on another thread than it started on";
    recorder_->close();
    return;
  }
  stop();
}

void Profile::stop() {
  if (stopped_) return;
  if (std::this_thread::get_id() != thread_) {
    throw std::logic_error("rpc::profiler::Profile::stop() must run on the thread that started it");
  }
  stopped_ = true;
  pop(std::move(shadowed_));
  recorder_->close();
}

// ------------------------------------------------------------ ServerProfile

ServerProfile::ServerProfile(ProfileOptions options)
    : ProfileResult(std::make_shared<Recorder>(now_ns(), options)) {
  (void)kHookInstalled;
  absl::MutexLock lock(&g_server_mu);
  if (server_slot()) {
    throw std::logic_error("rpc::profiler::ServerProfile: one is running in this process already");
  }
  server_slot() = recorder_;
  g_server_on.store(true);
}

ServerProfile::~ServerProfile() { stop(); }

void ServerProfile::stop() {
  if (stopped_) return;
  stopped_ = true;
  {
    absl::MutexLock lock(&g_server_mu);
    server_slot() = nullptr;
    g_server_on.store(false);
  }
  recorder_->close();
}

std::string KeyAverages::table(const std::string& sort_by, int row_limit,
                               int max_name_column_width) const {
  std::vector<EventStats> rows = rows_;
  auto key = [&sort_by](const EventStats& s) -> double {
    if (sort_by == "cpu_time_total") return static_cast<double>(s.total_ns);
    if (sort_by == "self_cpu_time_total") return static_cast<double>(s.self_ns);
    if (sort_by == "cpu_time") return static_cast<double>(s.total_ns) / std::max<int64_t>(1, s.count);
    if (sort_by == "cpu_memory_usage") return static_cast<double>(s.cpu_memory_usage);
    if (sort_by == "self_cpu_memory_usage") return static_cast<double>(s.self_cpu_memory_usage);
    return static_cast<double>(s.count);
  };
  if (!sort_by.empty()) {
    if (sort_by != "cpu_time_total" && sort_by != "self_cpu_time_total" &&
        sort_by != "cpu_time" && sort_by != "count" && sort_by != "cpu_memory_usage" &&
        sort_by != "self_cpu_memory_usage") {
      throw std::invalid_argument(
          "key_averages().table: unknown sort_by '" + sort_by +
          "' (cpu_time_total, self_cpu_time_total, cpu_time, count, cpu_memory_usage, "
          "self_cpu_memory_usage)");
    }
    std::stable_sort(rows.begin(), rows.end(),
                     [&key](const EventStats& a, const EventStats& b) { return key(a) > key(b); });
  }
  double self_total = 0;
  for (const auto& r : rows_) self_total += static_cast<double>(r.self_ns);
  if (row_limit >= 0 && static_cast<int>(rows.size()) > row_limit) rows.resize(row_limit);

  size_t name_width = 4;
  for (const auto& r : rows) name_width = std::max(name_width, r.name.size());
  name_width = std::min<size_t>(name_width, std::max(4, max_name_column_width));
  constexpr int kColumn = 12;
  std::vector<std::string> headers = {"Self CPU %", "Self CPU", "CPU total %", "CPU total",
                                      "CPU time avg"};
  if (memory_columns_) {
    headers.push_back("CPU Mem");
    headers.push_back("Self CPU Mem");
  }
  headers.push_back("# of Calls");
  headers.push_back("Node ID");
  // The input shapes come last, left-aligned and as wide as they are.
  auto line = [&](const std::string& name, const std::vector<std::string>& cells,
                  const std::string& shapes) {
    std::string out = absl::StrFormat("%*s", static_cast<int>(name_width), name);
    for (const auto& c : cells) out += absl::StrFormat("  %*s", kColumn, c);
    if (shape_column_) out += "  " + shapes;
    return out + "\n";
  };
  size_t shapes_width = 12;
  for (const auto& r : rows) shapes_width = std::max(shapes_width, r.input_shapes.size());
  std::string separator = std::string(name_width, '-');
  for (size_t i = 0; i < headers.size(); ++i) separator += "  " + std::string(kColumn, '-');
  if (shape_column_) separator += "  " + std::string(shapes_width, '-');
  separator += "\n";

  std::string out = separator + line("Name", headers, "Input Shapes") + separator;
  for (const auto& r : rows) {
    std::string name = r.name;
    if (name.size() > name_width) name = name.substr(0, name_width - 3) + "...";
    std::vector<std::string> cells = {
        format_share(r.self_ns, self_total), format_time(r.self_ns),
        r.rpc ? "0" : format_share(r.total_ns, self_total), format_time(r.total_ns),
        format_time(static_cast<double>(r.total_ns) / std::max<int64_t>(1, r.count))};
    if (memory_columns_) {
      cells.push_back(format_memory(r.cpu_memory_usage));
      cells.push_back(format_memory(r.self_cpu_memory_usage));
    }
    cells.push_back(std::to_string(r.count));
    cells.push_back(std::to_string(r.node));
    out += line(name, cells, r.input_shapes);
  }
  out += separator;
  out += "Self CPU time total: " + format_time(self_total) + "\n";
  return out;
}

void ProfileResult::export_chrome_trace(const std::string& path) const {
  const std::vector<Event> events = this->events();
  const std::map<int, std::string> names = node_names();
  std::map<int, std::set<int64_t>> threads;
  for (const Event& e : events) threads[e.node].insert(e.thread);

  std::string out = "{\"traceEvents\": [\n";
  bool first = true;
  auto emit = [&](const std::string& record) {
    if (!first) out += ",\n";
    first = false;
    out += record;
  };
  for (const auto& [node, tids] : threads) {
    auto it = names.find(node);
    const std::string label = it == names.end() ? absl::StrCat("node_id: ", node)
                                                : absl::StrCat(it->second, " (node_id: ", node, ")");
    emit(absl::StrCat("{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": ", node,
                      ", \"tid\": 0, \"args\": {\"name\": ", json_string(label), "}}"));
    emit(absl::StrCat("{\"ph\": \"M\", \"name\": \"process_sort_index\", \"pid\": ", node,
                      ", \"tid\": 0, \"args\": {\"sort_index\": ", node, "}}"));
    for (int64_t tid : tids) {
      emit(absl::StrCat("{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": ", node,
                        ", \"tid\": ", tid, ", \"args\": {\"name\": \"thread ", tid, "\"}}"));
    }
  }
  int64_t async_id = 0;
  for (const Event& e : events) {
    const std::string common =
        absl::StrCat("\"name\": ", json_string(e.name), ", \"pid\": ", e.node, ", \"tid\": ",
                     e.thread);
    if (e.rpc) {
      // RPCs overlap on their thread: async slices get tracks of their own.
      ++async_id;
      emit(absl::StrCat("{\"ph\": \"b\", \"cat\": \"rpc\", \"id\": ", async_id, ", ", common,
                        ", \"ts\": ", json_us(e.start_ns), ", \"args\": {\"node_id\": ", e.node,
                        "}}"));
      emit(absl::StrCat("{\"ph\": \"e\", \"cat\": \"rpc\", \"id\": ", async_id, ", ", common,
                        ", \"ts\": ", json_us(e.start_ns + e.duration_ns), "}"));
    } else {
      emit(absl::StrCat("{\"ph\": \"X\", \"cat\": \"cpu_op\", ", common,
                        ", \"ts\": ", json_us(e.start_ns), ", \"dur\": ", json_us(e.duration_ns),
                        ", \"args\": {\"node_id\": ", e.node, ", \"self_us\": ", json_us(e.self_ns),
                        e.input_shapes.empty() ? ""
                                               : ", \"Input Dims\": " + shapes_string(e.input_shapes),
                        "}}"));
    }
  }
  out += "\n], \"displayTimeUnit\": \"ms\"}\n";
  std::ofstream file(path);
  file << out;
  file.close();
  if (!file) throw std::runtime_error("export_chrome_trace: cannot write '" + path + "'");
}

}  // namespace ddprpc::rpc::profiler
