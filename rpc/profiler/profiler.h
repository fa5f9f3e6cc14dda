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
//
// ProfileOptions add the input shapes of operators and the CPU memory they
// allocate (minus what they free), also for the callee's operators.
// A ServerProfile records on the callee instead: every request this process
// serves while it runs, whoever the caller is.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace ddprpc::rpc::profiler {

struct ProfileOptions {
  bool record_shapes = false;  // Event::input_shapes
  bool profile_memory = false;  // Event::cpu_memory_usage
};

struct Event {
  std::string name;
  int node = -1;            // worker id where it ran
  int64_t thread = 0;       // thread index within that worker's process
  int64_t start_ns = 0;     // since the Profile started, on its clock
  int64_t duration_ns = 0;  // CPU total
  int64_t self_ns = 0;      // duration minus child operators (0 for RPCs)
  bool rpc = false;         // an RPC's end-to-end span (asynchronous)
  // With ProfileOptions::record_shapes, operators only: the sizes of each
  // input ({} for an input that is not a tensor).
  std::vector<std::vector<int64_t>> input_shapes;
  // With ProfileOptions::profile_memory, operators only: bytes allocated
  // minus bytes freed while it ran, with and without its child operators.
  int64_t cpu_memory_usage = 0;
  int64_t self_cpu_memory_usage = 0;
};

// One row of key_averages(): the events with the same name and node (and
// input shapes, when grouped by them).
struct EventStats {
  std::string name;
  int node = -1;
  int64_t count = 0;
  int64_t self_ns = 0;
  int64_t total_ns = 0;
  int64_t cpu_memory_usage = 0;
  int64_t self_cpu_memory_usage = 0;
  std::string input_shapes;  // as "[[2, 3], []]"; set when grouped by them
  bool rpc = false;
};

class KeyAverages {
 public:
  KeyAverages(std::vector<EventStats> rows, bool memory_columns, bool shape_column)
      : rows_(std::move(rows)), memory_columns_(memory_columns), shape_column_(shape_column) {}
  const std::vector<EventStats>& rows() const { return rows_; }
  // PyTorch's table: Name, Self CPU %, Self CPU, CPU total %, CPU total,
  // CPU time avg, [CPU Mem, Self CPU Mem,] # of Calls, Node ID, [Input
  // Shapes]; then "Self CPU time total". sort_by: "" (first occurrence),
  // "cpu_time_total", "self_cpu_time_total", "cpu_time" (average), "count",
  // "cpu_memory_usage" or "self_cpu_memory_usage", descending; at most
  // row_limit rows. Throws std::invalid_argument for another sort_by.
  std::string table(const std::string& sort_by = "", int row_limit = 100,
                    int max_name_column_width = 55) const;

 private:
  std::vector<EventStats> rows_;
  bool memory_columns_;
  bool shape_column_;
};

class Recorder;

// What a Profile or a ServerProfile recorded (complete once stopped).
class ProfileResult {
 public:
  // Ordered by start time.
  std::vector<Event> events() const;
  KeyAverages key_averages(bool group_by_input_shape = false) const;
  // Chrome trace-event JSON (chrome://tracing, Perfetto): one process per
  // node, one track per thread; RPCs are async slices on the caller. Throws
  // std::runtime_error when the file cannot be written.
  void export_chrome_trace(const std::string& path) const;
  // Worker names of the nodes seen (node id -> name).
  std::map<int, std::string> node_names() const;

 protected:
  explicit ProfileResult(std::shared_ptr<Recorder> recorder) : recorder_(std::move(recorder)) {}
  const std::shared_ptr<Recorder> recorder_;
};

class Profile : public ProfileResult {
 public:
  // Starts recording on the calling thread.
  explicit Profile(ProfileOptions options = {});
  // Stops if stop() was not called.
  ~Profile();
  Profile(const Profile&) = delete;
  Profile& operator=(const Profile&) = delete;

  // Stops recording; call it on the thread that created the Profile. Events
  // of RPCs still in flight are dropped (wait for them inside the scope).
  void stop();

 private:
  const std::thread::id thread_;
  std::shared_ptr<Recorder> shadowed_;  // the scope this one shadows on thread_
  bool stopped_ = false;
};

// PyTorch's server-process global profiler: while it runs, every request
// this process serves is recorded, as an event "rpc_request#<function>(
// <caller> -> <callee>)" from its arrival to its response, together with the
// operators (and nested RPCs) its function runs until it returns. One at a
// time per process: a second throws std::logic_error. Callers need not
// profile; requests served for a caller's Profile are recorded for both.
class ServerProfile : public ProfileResult {
 public:
  explicit ServerProfile(ProfileOptions options = {});
  ~ServerProfile();
  ServerProfile(const ServerProfile&) = delete;
  ServerProfile& operator=(const ServerProfile&) = delete;

  // Stops recording (from any thread); requests still running are dropped.
  void stop();

 private:
  bool stopped_ = false;
};

// Whether a Profile or a profiled request is recording on this thread.
bool is_profiling();

}  // namespace ddprpc::rpc::profiler
