#include "rpc/rendezvous/launch.h"

#include "gtest/gtest.h"

namespace ddprpc::rpc {
namespace {

LaunchOptions sh(int nprocs, const std::string& script) {
  LaunchOptions o;
  o.nprocs = nprocs;
  o.argv = {"/bin/sh", "-c", script};
  o.timeout = absl::Seconds(20);
  return o;
}

TEST(LaunchTest, AllRanksSucceed) {
  auto r = launch(sh(3, "test \"$WORLD_SIZE\" = 3 && test -n \"$MASTER_PORT\" && test \"$RANK\" -lt 3"));
  EXPECT_EQ(r.exit_code, 0) << r.message;
}

TEST(LaunchTest, OneFailureStopsTheOthers) {
  absl::Time start = absl::Now();
  auto r = launch(sh(3, "if [ \"$RANK\" = 1 ]; then exit 7; fi; sleep 30"));
  EXPECT_EQ(r.exit_code, 7);
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(LaunchTest, TimeoutKillsEverything) {
  auto o = sh(2, "sleep 30");
  o.timeout = absl::Milliseconds(300);
  absl::Time start = absl::Now();
  auto r = launch(o);
  EXPECT_TRUE(r.timed_out);
  EXPECT_EQ(r.exit_code, 124);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(LaunchTest, MissingProgramFails) {
  LaunchOptions o;
  o.argv = {"/nonexistent/program"};
  EXPECT_EQ(launch(o).exit_code, 127);
}

}  // namespace
}  // namespace ddprpc::rpc
