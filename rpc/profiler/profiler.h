// Profiler for RPC workloads, like torch.autograd.profiler.profile:
//
//   {
//     rpc::profiler::Profile prof;                       // records on this thread
//     auto f = rpc::rpc_async<at::Tensor>("worker1", "add", a, b);
//     f.wait();                                          // wait inside the scope
//     prof.stop();                                       // or leave the scope
//     std::cout << prof.key_averages().table("cpu_time_total", 10);
//     prof.export_chrome_trace("/tmp/trace.json");
//   }
//
// While a Profile is running, every RPC its thread makes is recorded as one
// event "rpc_async#add(worker0 -> worker1)" (api#function(from -> to)) lasting
// from the call until its future completes, and the libtorch operators the
// thread runs are recorded through RecordFunction callbacks. The callee of a
// profiled call records the operators (and nested RPCs) its function runs,
// until the function returns, and sends them back with the reply; they appear
// as "<rpc event>#remote_op: aten::add" with the callee's node id, placed on
// the caller's clock halfway through the round trip's slack. Callee support
// needs //rpc/profiler linked into the callee's binary too. Scopes on
// different threads are independent; a scope on a thread that already has
// one shadows it until it stops. With no Profile running anywhere in the
// process the RPC path pays one relaxed atomic load.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace ddprpc::rpc::profiler {

struct Event {
  std::string name;
  int node = -1;            // worker id where it ran
  int64_t thread = 0;       // thread index within that worker's process
  int64_t start_ns = 0;     // since the Profile started, on its clock
  int64_t duration_ns = 0;  // CPU total
  int64_t self_ns = 0;      // duration minus child operators (0 for RPCs)
  bool rpc = false;         // an RPC's end-to-end span (asynchronous)
};

// One row of key_averages(): the events with the same name and node.
struct EventStats {
  std::string name;
  int node = -1;
  int64_t count = 0;
  int64_t self_ns = 0;
  int64_t total_ns = 0;
  bool rpc = false;
};

class KeyAverages {
 public:
  explicit KeyAverages(std::vector<EventStats> rows) : rows_(std::move(rows)) {}
  const std::vector<EventStats>& rows() const { return rows_; }
  // PyTorch's table: Name, Self CPU %, Self CPU, CPU total %, CPU total,
  // CPU time avg, # of Calls, Node ID; then "Self CPU time total". sort_by:
  // "" (first occurrence), "cpu_time_total", "self_cpu_time_total",
  // "cpu_time" (average) or "count", descending; at most row_limit rows.
  // Throws std::invalid_argument for another sort_by.
  std::string table(const std::string& sort_by = "", int row_limit = 100,
                    int max_name_column_width = 55) const;

 private:
  std::vector<EventStats> rows_;
};

class Recorder;

class Profile {
 public:
  // Starts recording on the calling thread.
  Profile();
  // Stops if stop() was not called.
  ~Profile();
  Profile(const Profile&) = delete;
  Profile& operator=(const Profile&) = delete;

  // Stops recording; call it on the thread that created the Profile. Events
  // of RPCs still in flight are dropped (wait for them inside the scope).
  void stop();
  // What was recorded, ordered by start time (complete once stopped).
  std::vector<Event> events() const;
  KeyAverages key_averages() const;
  // Chrome trace-event JSON (chrome://tracing, Perfetto): one process per
  // node, one track per thread; RPCs are async slices on the caller. Throws
  // std::runtime_error when the file cannot be written.
  void export_chrome_trace(const std::string& path) const;
  // Worker names of the nodes seen (node id -> name).
  std::map<int, std::string> node_names() const;

 private:
  const std::shared_ptr<Recorder> recorder_;
  const std::thread::id thread_;
  std::shared_ptr<Recorder> shadowed_;  // the scope this one shadows on thread_
  bool stopped_ = false;
};

// Whether a Profile or a profiled request is recording on this thread.
bool is_profiling();

}  // namespace ddprpc::rpc::profiler
