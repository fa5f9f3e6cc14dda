#include "rpc/profiler/profiler.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <set>
#include <stdexcept>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "rpc/hooks.h"
#include "rpc/profiler/profiler.pb.h"
#include "rpc/rpc.h"

namespace ddprpc::rpc::profiler {

// Events of one Profile, or of one profiled request on its callee. Times are
// ns since `origin_ns` (the Profile's start; the callee's receipt of the
// request); node -1 means "the worker that owns this recorder".
class Recorder {
 public:
  explicit Recorder(int64_t origin_ns) : origin_ns(origin_ns) {}
  const int64_t origin_ns;

  void add(Event event) {
    absl::MutexLock lock(&mu_);
    if (!closed_) events_.push_back(std::move(event));
  }
  void add_all(std::vector<Event> events, const std::map<int, std::string>& names) {
    absl::MutexLock lock(&mu_);
    if (closed_) return;
    for (auto& e : events) events_.push_back(std::move(e));
    for (const auto& [id, name] : names) names_.emplace(id, name);
  }
  void note_call(const WorkerInfo& from, const WorkerInfo& to) {
    absl::MutexLock lock(&mu_);
    if (self_node_ < 0) self_node_ = from.id;
    names_.emplace(from.id, from.name);
    names_.emplace(to.id, to.name);
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
  OpContext* parent = nullptr;
};

struct ThreadState {
  std::shared_ptr<Recorder> top;  // where this thread's events go
  int depth = 0;                  // recorders pushed
  at::CallbackHandle callback = at::INVALID_CALLBACK_HANDLE;
  OpContext* open = nullptr;      // innermost running operator
};
thread_local ThreadState t_state;

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  ThreadState& ts = t_state;
  if (!ts.top) return nullptr;
  auto ctx = std::make_unique<OpContext>();
  ctx->recorder = ts.top;
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
  if (ts.open == ctx) {
    ts.open = ctx->parent;
    if (ctx->parent) ctx->parent->children_ns += duration;
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
  ctx->recorder->add(std::move(event));
}

// Makes `recorder` this thread's destination; returns the one it shadows.
std::shared_ptr<Recorder> push(std::shared_ptr<Recorder> recorder) {
  ThreadState& ts = t_state;
  std::shared_ptr<Recorder> previous = std::move(ts.top);
  ts.top = std::move(recorder);
  if (ts.depth++ == 0) {
    ts.callback = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_op_start, &on_op_end)
            .needsInputs(false)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                     at::RecordScope::TORCHSCRIPT_FUNCTION, at::RecordScope::USER_SCOPE}));
    g_recording_threads.fetch_add(1, std::memory_order_relaxed);
  }
  return previous;
}

void pop(std::shared_ptr<Recorder> previous) {
  ThreadState& ts = t_state;
  ts.top = std::move(previous);
  if (--ts.depth == 0) {
    at::removeCallback(ts.callback);
    ts.callback = at::INVALID_CALLBACK_HANDLE;
    ts.open = nullptr;
    g_recording_threads.fetch_sub(1, std::memory_order_relaxed);
  }
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

// Callee side of one profiled request.
struct RequestState {
  std::shared_ptr<Recorder> recorder;  // created when the function starts
};

class ProfilerHook : public RpcHook {
 public:
  std::shared_ptr<void> start_call(const OutgoingCall& call, MessageExt* ext) override {
    if (g_recording_threads.load(std::memory_order_relaxed) == 0) return nullptr;
    const std::shared_ptr<Recorder>& recorder = t_state.top;
    if (!recorder) return nullptr;
    recorder->note_call(call.from, call.to);
    auto state = std::make_shared<CallState>();
    state->recorder = recorder;
    state->name = absl::StrCat(call.api, "#", call.display, "(", call.from.name, " -> ",
                               call.to.name, ")");
    state->from = call.from.id;
    state->to = call.to.id;
    state->thread = thread_index();
    (*ext)[kProfileKey] = "1";
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
    ::ddprpc::profiling::ProfiledRequest shipped;
    if (!shipped.ParseFromString(it->second)) {
      LOG(WARNING) << "profiler: malformed remote events in the reply to " << state->name;
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
      events.push_back(std::move(event));
    }
    recorder.add_all(std::move(events), {shipped.node_names().begin(), shipped.node_names().end()});
  }

  std::shared_ptr<void> incoming_request(int src, const c10::IValue& args,
                                         const MessageExt& ext) override {
    if (ext.empty() || ext.find(kProfileKey) == ext.end()) return nullptr;
    return std::make_shared<RequestState>();
  }

  std::shared_ptr<void> enter(const std::shared_ptr<void>& opaque) override {
    if (!opaque) return nullptr;
    auto* request = static_cast<RequestState*>(opaque.get());
    // Times count from the request's arrival, so time spent waiting for a
    // worker thread is part of the callee's span (and not of the network's).
    int64_t origin = now_ns();
    if (const CallContext* call = current_call()) {
      origin -= std::max<int64_t>(0, absl::ToInt64Nanoseconds(absl::Now() - call->received));
    }
    request->recorder = std::make_shared<Recorder>(origin);
    struct Guard {
      std::shared_ptr<Recorder> previous;
      ~Guard() { pop(std::move(previous)); }
    };
    auto guard = std::make_shared<Guard>();
    guard->previous = push(request->recorder);
    return guard;
  }

  void outgoing_response(int dest, const std::shared_ptr<void>& opaque, const c10::IValue& result,
                         MessageExt* ext) override {
    if (!opaque) return;
    const auto& recorder_ptr = static_cast<RequestState*>(opaque.get())->recorder;
    if (!recorder_ptr) return;  // the function never ran
    Recorder& recorder = *recorder_ptr;
    recorder.close();
    ::ddprpc::profiling::ProfiledRequest shipped;
    shipped.set_duration_ns(now_ns() - recorder.origin_ns);
    for (const Event& e : recorder.events()) {
      ::ddprpc::profiling::ProfiledEvent* out = shipped.add_events();
      out->set_name(e.name);
      out->set_node(e.node);
      out->set_thread(e.thread);
      out->set_start_ns(e.start_ns);
      out->set_duration_ns(e.duration_ns);
      out->set_self_ns(e.self_ns);
      out->set_rpc(e.rpc);
    }
    for (const auto& [id, name] : recorder.names()) (*shipped.mutable_node_names())[id] = name;
    (*ext)[kEventsKey] = shipped.SerializeAsString();
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

}  // namespace

bool is_profiling() { return t_state.top != nullptr; }

// ------------------------------------------------------------------ Profile

Profile::Profile()
    : recorder_(std::make_shared<Recorder>(now_ns())), thread_(std::this_thread::get_id()) {
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

std::vector<Event> Profile::events() const {
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

std::map<int, std::string> Profile::node_names() const { return recorder_->names(); }

KeyAverages Profile::key_averages() const {
  std::vector<EventStats> rows;
  std::map<std::pair<std::string, int>, size_t> index;
  for (const Event& e : events()) {
    auto [it, inserted] = index.emplace(std::make_pair(e.name, e.node), rows.size());
    if (inserted) {
      EventStats stats;
      stats.name = e.name;
      stats.node = e.node;
      stats.rpc = e.rpc;
      rows.push_back(std::move(stats));
    }
    EventStats& row = rows[it->second];
    ++row.count;
    row.self_ns += e.self_ns;
    row.total_ns += e.duration_ns;
  }
  return KeyAverages(std::move(rows));
}

std::string KeyAverages::table(const std::string& sort_by, int row_limit,
                               int max_name_column_width) const {
  std::vector<EventStats> rows = rows_;
  auto key = [&sort_by](const EventStats& s) -> double {
    if (sort_by == "cpu_time_total") return static_cast<double>(s.total_ns);
    if (sort_by == "self_cpu_time_total") return static_cast<double>(s.self_ns);
    if (sort_by == "cpu_time") return static_cast<double>(s.total_ns) / std::max<int64_t>(1, s.count);
    return static_cast<double>(s.count);
  };
  if (!sort_by.empty()) {
    if (sort_by != "cpu_time_total" && sort_by != "self_cpu_time_total" &&
        sort_by != "cpu_time" && sort_by != "count") {
      throw std::invalid_argument("key_averages().table: unknown sort_by '" + sort_by +
                                  "' (cpu_time_total, self_cpu_time_total, cpu_time, count)");
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
  const char* headers[] = {"Self CPU %",   "Self CPU",   "CPU total %", "CPU total",
                           "CPU time avg", "# of Calls", "Node ID"};
  auto line = [&](const std::string& name, const std::vector<std::string>& cells) {
    std::string out = absl::StrFormat("%*s", static_cast<int>(name_width), name);
    for (const auto& c : cells) out += absl::StrFormat("  %*s", kColumn, c);
    return out + "\n";
  };
  std::string separator = std::string(name_width, '-');
  for (size_t i = 0; i < 7; ++i) separator += "  " + std::string(kColumn, '-');
  separator += "\n";

  std::string out = separator + line("Name", {headers, headers + 7}) + separator;
  for (const auto& r : rows) {
    std::string name = r.name;
    if (name.size() > name_width) name = name.substr(0, name_width - 3) + "...";
    out += line(name, {format_share(r.self_ns, self_total), format_time(r.self_ns),
                       r.rpc ? "0" : format_share(r.total_ns, self_total), format_time(r.total_ns),
                       format_time(static_cast<double>(r.total_ns) / std::max<int64_t>(1, r.count)),
                       std::to_string(r.count), std::to_string(r.node)});
  }
  out += separator;
  out += "Self CPU time total: " + format_time(self_total) + "\n";
  return out;
}

void Profile::export_chrome_trace(const std::string& path) const {
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
