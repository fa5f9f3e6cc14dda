// The benchmarks' one way to run their roles as processes and get a result
// back. The launching process calls run_roles(), which starts this binary
// again (its own arguments, then `args`) as `nprocs` ranks through
// rpc::launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; all stopped
// when one fails or the timeout passes), and tells them where a result goes.
// The rank that has the result calls write_result() with a JSON document;
// run_roles returns how the processes ended and that document, parsed with
// protobuf's JSON parser (JsonValue). The result file is removed once read.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "benchmarks/common.h"

namespace ddprpc::benchmarks {

struct RolesOptions {
  int nprocs = 1;
  // After this binary's own arguments (a later flag wins).
  std::vector<std::string> args;
  // Extra environment for every rank; "" as value unsets the variable.
  std::vector<std::pair<std::string, std::string>> env;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port
  absl::Duration timeout = absl::InfiniteDuration();
  // After the first failure, how long the other ranks may take to notice
  // and report it before they are stopped.
  absl::Duration grace_period = absl::ZeroDuration();
  // Where a rank starts: the binary's main past its one-time set-up
  // (gflags' usage message); by default the one given to run_main(). With
  // one, the ranks are forked from this process and run it with their
  // arguments, every flag first reset to its default, instead of starting
  // the binary again (rpc::LaunchOptions::entry; a launcher with threads
  // still starts it again).
  int (*entry)(int argc, char** argv) = nullptr;
  // Network namespaces the ranks run in: rank r in network_namespaces[r %
  // size] (NetworkHosts makes them; master_addr is then rank 0's address
  // there). Ranks are then always started anew. Empty: this process's own.
  std::vector<std::string> network_namespaces;
};

// A benchmark's main after setting its usage message: runs rank_main and
// makes it where the ranks of run_roles start (RolesOptions::entry).
int run_main(int argc, char** argv, int (*rank_main)(int argc, char** argv));

struct RolesResult {
  // How the processes ended (rpc::launch's result).
  int exit_code = 0;  // 0 when every rank exited 0
  bool timed_out = false;
  int failed_rank = -1;
  std::string message;  // what went wrong, for humans
  // What a rank wrote with write_result (null when none did).
  bool has_result = false;
  JsonValue result;
  // Why there is no result: none written, or not JSON.
  std::string result_error;

  bool ok() const { return exit_code == 0 && has_result; }
};

// Starts the ranks, waits for them and reads the result (see above).
RolesResult run_roles(int argc, char** argv, const RolesOptions& options);

// True in a rank that run_roles started.
bool started_by_run_roles();

// In a rank started by run_roles: hands `result` back (the last call wins).
// False, with *error saying why, outside such a rank or when it cannot be
// written.
bool write_result(const JsonValue& result, std::string* error = nullptr);

// PyTorch's side as ranks of its own: reference_python() runs `script`
// with `args`, `report_flag` and the report's path (as run_reference), as
// `options.nprocs` processes
// placed as run_roles places its ranks (RANK, WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT set; env, network_namespaces, timeout). One rank writes the
// report. Their output, prefixed by rank, is the run's output.
ReferenceRun run_reference_ranks(const std::string& script, const std::vector<std::string>& args,
                                 const RolesOptions& options,
                                 const std::string& report_flag = "--json");
bool write_result(const Json& result, std::string* error = nullptr);

}  // namespace ddprpc::benchmarks
