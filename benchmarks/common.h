// Shared pieces of the benchmark binaries: flags with a focused --help,
// percentiles, a text table, JSON (built, read and written through
// protobuf's JsonValue), and paths.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/struct.pb.h>

#include "absl/time/time.h"
#include "ddp/process_group.h"
#include "rpc/agent.h"

namespace ddprpc::benchmarks {

// A parsed JSON document: protobuf's google.protobuf.Value holds any JSON
// value, and protobuf's JSON parser and printer read and write it. Every
// JSON document the benchmarks read or write is one of these.
using JsonValue = google::protobuf::Value;

// Parses gflags; --help lists only the flags defined in files whose path
// contains `flag_file_filter` (not glog's), then exits.
void parse_flags(int* argc, char*** argv, const char* flag_file_filter);
// --allow_insecure (the other security flags go to the environment).
bool allow_insecure();

// The runtime settings the benchmarks measure with, from their flags. The
// library's defaults are what is safe inside someone else's process; the
// benchmarks ask for the fast settings explicitly (--sched_batch,
// --spin_us, both on by default here), and parse_flags has already chosen
// gRPC's low-latency polling and turned abseil's mutex deadlock detection
// off (--mutex_deadlock_detection).
// RpcBackendOptions with --sched_batch, --spin_us, --same_host_transport,
// --capture_frames and --allow_insecure.
rpc::RpcBackendOptions backend_options();
// ProcessGroupOptions with --same_host_allreduce and --spin_us.
ddp::ProcessGroupOptions group_options();
// Those settings in one line, for every benchmark's Info header and JSON.
std::string runtime_settings();

// RANK from the environment, or -1 when not launched as a worker.
int env_rank();
int cpu_count();
// The allocator behind malloc in this process: "tcmalloc MAJOR.MINOR" when
// gperftools' is linked in (//third_party:tcmalloc, as every benchmark
// binary outside the sanitizer builds), else "glibc malloc".
std::string allocator_name();
// The Python that runs PyTorch's side of a benchmark: --python, else the
// one whose PyTorch this build's libtorch came from (./bazelw: the
// project's .venv), else python3 on PATH.
std::string reference_python();
// "libtorch 2.13.0 (CPU)": the libtorch this binary was built against.
std::string libtorch_version();
// torch.__version__ of reference_python(), e.g. "2.13.0+cpu"; "none" when
// that Python cannot import torch. Asked once, then remembered.
std::string pytorch_version();
// "libtorch 2.13.0 (CPU); PyTorch's side: torch 2.13.0+cpu (PYTHON)", for
// every benchmark's Info header.
std::string versions();
// Keeps freed tensor memory in the process: glibc otherwise returns large
// blocks to the kernel (munmap, or madvise when it trims a thread's arena)
// and every later tensor of that size page-faults its memory in again.
// Tensors of a training step (gradient buckets, embedding gradients) are
// allocated and freed every step; on this VM the faults cost ~20% of a
// ddp_rpc iteration. Call first thing in main(). Under tcmalloc it does
// nothing (tcmalloc's mallopt is empty): tcmalloc keeps freed spans in its
// page heap and hands few back at a time.
void keep_freed_memory();
// The percentile method of every figure we print, ours and PyTorch's side
// alike: numpy.percentile's default (linear interpolation between the two
// nearest ranks). p in [0, 1]: the sorted samples' value at position
// p * (n - 1), interpolated; 0 for no samples.
double percentile(std::vector<double> samples, double p);

// How many times faster ddprpc is than PyTorch on one figure: ours /
// theirs for a rate (`higher_is_better`), theirs / ours for a time; 0 when
// either figure is missing (not above 0).
double speedup(double ours, double theirs, bool higher_is_better);
// speedup() as a table cell: "2.31x" (`decimals` after the point), "-"
// when missing.
std::string speedup_cell(double ours, double theirs, bool higher_is_better, int decimals = 2);

// The speedups of interleaved rounds: round i of ours against round i of
// PyTorch's (rounds missing on either side are left out).
struct RoundSpeedups {
  std::vector<double> per_round;
  double median() const { return percentile(per_round, 0.5); }
  // "2.10 2.31 2.52".
  std::string list() const;
  // {"per_round": [...], "median": m}.
  JsonValue json() const;
};
RoundSpeedups round_speedups(const std::vector<double>& ours, const std::vector<double>& theirs,
                             bool higher_is_better);

std::string self_exe();
std::string temp_path(const std::string& stem);
// The environment variable (name, value) that tells a process this one
// starts whether this one's stderr is a terminal, for its Progress
// (run_roles, harness.h, passes it on).
std::pair<std::string, std::string> progress_terminal_env();

// Progress of a long phase on stderr. When stderr is a terminal (or was in
// the process that launched this one), one line
// updated in place; otherwise at most `max_lines` lines for the phase
// (every total/max_lines steps, and the last). A line reads
// "<what> <done>/<total>, <elapsed> s, ETA <s> s, <detail>".
class Progress {
 public:
  Progress(std::string what, int64_t total, int max_lines = 20);
  void update(int64_t done, const std::string& detail = "");

 private:
  const std::string what_;
  const int64_t total_;
  const int64_t every_;  // steps between lines when not on a terminal
  const bool terminal_;
  const double start_s_;
};
// The whole file, or "" if it cannot be read.
std::string read_file(const std::string& path);
// A file of this repository (e.g. a reference script in the binary's
// runfiles), or "" if not found.
std::string source_path(const std::string& relative);
// Resolves a relative output path against the directory `bazel run` was
// started from.
std::string output_path(const std::string& path);
// Runs argv, capturing stdout+stderr; returns the exit code.
int run_command(const std::vector<std::string>& argv, std::string* output);

class Table {
 public:
  explicit Table(std::vector<std::string> header) : rows_{std::move(header)} {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string str() const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

// Builds a JsonValue in document order:
//   json.begin_object().key("a").value(1).key("b").begin_array()...
// A value goes where the document is (after a key in an object, at the end
// of an array); a second top-level value replaces the first.
class Json {
 public:
  Json& begin_object();
  Json& end_object();
  Json& begin_array();
  Json& end_array();
  Json& key(const std::string& k);
  Json& value(double v);  // not finite: null
  Json& value(int v) { return value(static_cast<double>(v)); }
  Json& value(int64_t v) { return value(static_cast<double>(v)); }
  Json& value(const std::string& s);
  Json& value(const char* s) { return value(std::string(s)); }
  Json& value(bool b);
  // A document built elsewhere (a rank's figures, PyTorch's report).
  Json& value(const JsonValue& v);
  // "libtorch", "pytorch", "python" and "runtime" keys with their values
  // (versions(), runtime_settings()).
  Json& versions();

  const JsonValue& root() const { return root_; }
  std::string str() const;  // to_json(root())
  bool write(const std::string& path) const;

 private:
  JsonValue* next();  // where the next value goes

  JsonValue root_;
  std::vector<JsonValue*> open_;  // the objects and arrays begun, innermost last
  std::string key_;               // of the next value, in an object
};

// PyTorch's side of a benchmark: the script, run once under
// reference_python() with its report read back.
//
// `flag_value` when given (a --pytorch_script flag), else the repository's
// file `relative` (source_path); "" when not found.
std::string reference_script(const std::string& flag_value, const std::string& relative);

struct ReferenceRun {
  int exit_code = -1;
  std::string output;  // its stdout and stderr
  JsonValue report;    // null unless it exited 0 and wrote a JSON report
  bool ok() const { return exit_code == 0 && report.kind_case() != JsonValue::kNullValue; }
  // Why it failed, then the end of its output (at most `tail` bytes).
  std::string failure(size_t tail = 2000) const;
};

// Runs `script` with `args`, then `report_flag` and a temporary path where
// it writes its JSON report (with report_flag empty: the path alone, last),
// and reads that report. The temporary file is removed.
ReferenceRun run_reference(const std::string& script, const std::vector<std::string>& args,
                           const std::string& report_flag = "--json");
// The report a reference run left at `path`, into run->report (null when
// the run failed or the file is not JSON, the reason added to its output);
// the file is removed.
void take_report(const std::string& path, ReferenceRun* run);

// Parses `text`; false (with *error, when given, saying why) if it is not JSON.
bool parse_json(const std::string& text, JsonValue* out, std::string* error = nullptr);
// Compact JSON text of `v` (an object's keys in no fixed order).
std::string to_json(const JsonValue& v);
// Writes to_json(v) and a newline to `path`; false (logged) when it cannot.
bool write_json(const JsonValue& v, const std::string& path);
// Follows object keys from `v`; nullptr where a key is missing or a value on
// the way is not an object.
const JsonValue* json_at(const JsonValue& v, std::initializer_list<std::string> keys);
// json_at(...)->number_value(), or `fallback` when missing or not a number.
double json_number(const JsonValue& v, std::initializer_list<std::string> keys,
                   double fallback = -1);

}  // namespace ddprpc::benchmarks
