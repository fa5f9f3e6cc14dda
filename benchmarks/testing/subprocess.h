// Test helpers that run a benchmark binary the way a user does: as a
// subprocess with its own stdout/stderr files, bounded in time, killed (with
// its ranks, which die with it) if the test fails early.
#pragma once

#include <sys/types.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "benchmarks/common.h"

namespace ddprpc::benchmarks::testing {

using ::ddprpc::benchmarks::json_at;
using ::ddprpc::benchmarks::json_number;
using ::ddprpc::benchmarks::JsonValue;
using ::ddprpc::benchmarks::parse_json;
using ::ddprpc::benchmarks::read_file;
using ::ddprpc::benchmarks::to_json;

// $TEST_SRCDIR/ddprpc/<target path>, e.g. binary("benchmarks/ddp_rpc").
std::string binary(const std::string& path);
// $TEST_TMPDIR/<name>.
std::string test_tmp(const std::string& name);
// The last 3000 characters, for failure messages.
std::string tail(const std::string& s);

class Child {
 public:
  // Starts `path` with `args`; stdout/stderr go to $TEST_TMPDIR/<tag>.out/.err.
  // Its processes carry DDPRPC_TEST_RUN=<test pid>-<tag> (see run_processes).
  Child(const std::string& path, const std::vector<std::string>& args, const std::string& tag);
  ~Child();  // kills the process if it still runs
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  // Waits up to `timeout`; the exit code (128 for a signal), or -1 on timeout.
  int wait_for(absl::Duration timeout);
  std::string out() const { return read_file(out_path_); }
  std::string err() const { return read_file(err_path_); }
  // The process started (`path` itself).
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  const std::string out_path_, err_path_;
};

// The numbers of the JSON array at `keys` (empty if there is none).
std::vector<double> json_numbers(const JsonValue& v, std::initializer_list<std::string> keys);
// numpy.percentile(samples, pct)'s default method for pct in [0, 100]: the
// value at rank pct/100 * (n - 1) of the sorted samples, linearly
// interpolated. The tests' own oracle, written apart from the benchmarks'.
double numpy_percentile(std::vector<double> samples, double pct);

// Live processes started (directly or not) by the Child tagged `tag`.
std::vector<pid_t> run_processes(const std::string& tag);
// The one of them that runs rank <rank> (RANK=<rank> in its environment,
// or the launcher's <rank>-th child for ranks forked without exec), or -1.
pid_t find_rank(const std::string& tag, int rank);

}  // namespace ddprpc::benchmarks::testing
