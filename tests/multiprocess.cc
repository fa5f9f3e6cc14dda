#include "tests/multiprocess.h"

#include <unistd.h>

#include <cstdlib>

#include "rpc/rendezvous/launch.h"
#include "rpc/rpc.h"
#include "rpc/rendezvous/launch_env.h"

namespace ddprpc::testing {
namespace {

constexpr char kWorkerEnv[] = "DDPRPC_TEST_WORKER";
constexpr char kNetworkPathsEnv[] = "DDPRPC_TEST_NETWORK_PATHS";

}  // namespace

bool is_worker() { return std::getenv(kWorkerEnv) != nullptr; }

void prepare_worker() {
  for (const auto& s : rpc::kLowLatencyGrpcEnvironment) ::setenv(s.name, s.value, /*overwrite=*/0);
}
int rank() { return rpc::launch_env().rank; }
int world_size() { return rpc::launch_env().world_size; }

bool network_paths_only() {
  const char* v = std::getenv(kNetworkPathsEnv);
  return v != nullptr && std::string(v) == "1";
}

rpc::RpcBackendOptions backend_options() {
  rpc::RpcBackendOptions options;
  options.same_host_transport = !network_paths_only();
  return options;
}

std::string worker_name(int r) { return "worker" + std::to_string(r < 0 ? rank() : r); }

int run_workers(const std::string& test_name, int nprocs, absl::Duration timeout) {
  rpc::LaunchOptions options;
  options.nprocs = nprocs;
  options.argv = {"/proc/self/exe", "--gtest_filter=" + test_name};
  char exe[4096];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) options.argv[0] = std::string(exe, n);
  options.env = {
      {kWorkerEnv, "1"},
      // Ranks must not write the parent's test report or shard status.
      {"XML_OUTPUT_FILE", ""},
      {"GTEST_OUTPUT", ""},
      {"TEST_PREMATURE_EXIT_FILE", ""},
      {"TEST_SHARD_STATUS_FILE", ""},
  };
  options.timeout = timeout;
  return rpc::launch(options).exit_code;
}

void die_abruptly() {
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(0);
}

}  // namespace ddprpc::testing
