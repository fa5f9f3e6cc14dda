// Multi-process gtest cases: the test re-runs its own binary as `nprocs`
// real processes on loopback (through rpc::launch), each running the body
// with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, and passes only if every
// rank passes. Bounded by a timeout; all processes are killed on failure.
//
//   MULTIPROCESS_TEST(RpcTest, Echo, 3) {
//     rpc::init_rpc(ddprpc::testing::worker_name(), ddprpc::testing::rank(), 3);
//     ...EXPECT_*/ASSERT_* as usual...
//   }
#pragma once

#include <string>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "rpc/agent.h"

namespace ddprpc::testing {

// True inside a spawned rank.
bool is_worker();
// What a spawned rank does before the test's body: gRPC's polling and read
// buffers as the benchmarks set them (rpc::kLowLatencyGrpcEnvironment), so
// that the tests run the transport as it is measured.
void prepare_worker();
int rank();
int world_size();

// DDPRPC_TEST_NETWORK_PATHS=1 in the test's environment: the ranks take
// the paths of workers on separate hosts (gRPC for every peer, Gloo's TCP
// algorithms for every allreduce). CI runs the tests once this way.
bool network_paths_only();
// The options the tests' workers start from: the library's defaults, with
// the same-host transport off when network_paths_only().
rpc::RpcBackendOptions backend_options();
// "worker<rank>"
std::string worker_name(int rank = -1);

// Runs this binary's test `test_name` ("Suite.Name") as `nprocs` processes;
// returns the launcher's exit code (0 when every rank passed).
int run_workers(const std::string& test_name, int nprocs, absl::Duration timeout);

// Ends this process at once, as a crash would (sockets reset, no cleanup),
// with exit status 0 so the launcher does not count it as a failure.
[[noreturn]] void die_abruptly();

}  // namespace ddprpc::testing

#define MULTIPROCESS_TEST_WITH_TIMEOUT(suite, name, nprocs, timeout)                   \
  static void suite##_##name##_Body();                                                \
  TEST(suite, name) {                                                                 \
    if (::ddprpc::testing::is_worker()) {                                             \
      ::ddprpc::testing::prepare_worker();                                            \
      suite##_##name##_Body();                                                        \
      return;                                                                         \
    }                                                                                 \
    ASSERT_EQ(0, ::ddprpc::testing::run_workers(#suite "." #name, nprocs, timeout)); \
  }                                                                                   \
  static void suite##_##name##_Body()

#define MULTIPROCESS_TEST(suite, name, nprocs) \
  MULTIPROCESS_TEST_WITH_TIMEOUT(suite, name, nprocs, absl::Seconds(90))
