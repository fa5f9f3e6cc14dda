// Local launcher, like torch.multiprocessing.spawn / torchrun on one host:
// runs `nprocs` copies of a program with RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR and MASTER_PORT set, streams their output prefixed by rank,
// and stops the rest as soon as one fails (or the timeout passes).
// Children die with the launcher (PR_SET_PDEATHSIG). Unless the launcher's
// environment names one (DDPRPC_AUTH_TOKEN or DDPRPC_AUTH_TOKEN_FILE), the
// children share a new random job token: the job is authenticated with no
// configuration.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ddprpc::rpc {

struct LaunchOptions {
  int nprocs = 1;
  // Program path and arguments; argv[0] is executed.
  std::vector<std::string> argv;
  // Extra environment for every process; "" as value unsets the variable.
  std::vector<std::pair<std::string, std::string>> env;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: pick a free port
  absl::Duration timeout = absl::InfiniteDuration();
  bool prefix_output = true;  // "[rank N] " before every line
  // When set, the ranks' lines (both streams) and the launcher's own are
  // appended here instead of going to this process's stdout and stderr.
  std::string* output = nullptr;
  // After the first failure, how long the other ranks may take to notice
  // and report it themselves before they are stopped.
  absl::Duration grace_period = absl::ZeroDuration();
  // When set, children are forked without exec and run entry(argv) in the
  // image they share with the launcher, then exit with its result (stdio
  // flushed, static destructors skipped): they start with every library
  // already loaded and initialized (libtorch takes most of a second of CPU
  // per process). Only done while the launcher has a single thread, since
  // a child inherits no other thread but every lock another held; otherwise
  // argv[0] is executed as usual. The environment is set as for exec.
  std::function<int(const std::vector<std::string>& argv)> entry;
  // Network namespaces (names under /var/run/netns, as `ip netns` makes
  // them, or paths): rank r joins network_namespaces[r % size] before it
  // starts, as on a host of its own. Needs CAP_SYS_ADMIN; a rank that
  // cannot join fails at once (exit 126), saying why. Ranks in a namespace
  // are always executed anew, never forked with `entry`, so nothing of the
  // launcher's network state (sockets, cached addresses) comes with them.
  // Empty: every rank in the launcher's own.
  std::vector<std::string> network_namespaces;
};

struct LaunchResult {
  // 0 when every process exited 0; otherwise the first failure's exit code
  // (128 + signal for a signal), or 124 on timeout.
  int exit_code = 0;
  bool timed_out = false;
  int failed_rank = -1;
  std::string message;  // what went wrong, for humans
};

LaunchResult launch(const LaunchOptions& options);

// The number of threads of this process (from /proc/self/task; 0 if unknown).
int thread_count();

// A TCP port on 127.0.0.1 that was free a moment ago, taken from below the
// kernel's ephemeral range where it can be (no bind(0) or outgoing connection
// is handed it meanwhile); 0 if none was found.
int pick_free_port();

}  // namespace ddprpc::rpc
