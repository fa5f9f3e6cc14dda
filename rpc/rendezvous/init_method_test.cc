#include "rpc/rendezvous/init_method.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace ddprpc::rpc {
namespace {

const char* const kVars[] = {"RANK",         "WORLD_SIZE",    "MASTER_ADDR",  "MASTER_PORT",
                             "SLURM_PROCID", "SLURM_NTASKS",  "SLURM_JOB_ID", "SLURM_LOCALID",
                             "SLURM_STEP_NUM_TASKS", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST"};

class InitMethodTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kVars) ::unsetenv(v);
  }
  void TearDown() override { SetUp(); }
};

std::string error_of(const std::string& init_method) {
  try {
    parse_init_method(init_method);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST_F(InitMethodTest, TcpGivesHostAndPort) {
  StoreAddress a = parse_init_method("tcp://10.1.2.3:29500");
  EXPECT_EQ(a.host, "10.1.2.3");
  EXPECT_EQ(a.port, 29500);
  EXPECT_EQ(parse_init_method("tcp://localhost:7").host, "127.0.0.1");
  EXPECT_EQ(parse_init_method("tcp://[::1]:7").host, "[::1]");
}

TEST_F(InitMethodTest, MalformedOnesSayWhatIsWrong) {
  EXPECT_NE(error_of("tcp://host").find("has no port"), std::string::npos);
  EXPECT_NE(error_of("tcp://host:0").find("invalid rendezvous port"), std::string::npos);
  EXPECT_NE(error_of("tcp://host:70000").find("invalid rendezvous port"), std::string::npos);
  EXPECT_NE(error_of("tcp://:80").find("has no host"), std::string::npos);
  EXPECT_NE(error_of("file:///tmp/x").find("unsupported init_method"), std::string::npos);
  EXPECT_NE(error_of("env://").find("MASTER_ADDR"), std::string::npos);
}

TEST_F(InitMethodTest, EnvReadsMasterAddrAndPort) {
  ::setenv("MASTER_ADDR", "localhost", 1);
  ::setenv("MASTER_PORT", "1234", 1);
  StoreAddress a = parse_init_method("env://");
  EXPECT_EQ(a.host, "127.0.0.1");
  EXPECT_EQ(a.port, 1234);
  EXPECT_EQ(parse_init_method("").port, 1234);
  ::setenv("MASTER_PORT", "x", 1);
  EXPECT_NE(error_of("env://").find("MASTER_PORT"), std::string::npos);
}

TEST_F(InitMethodTest, RankAndSizeFromArgumentsOrLauncher) {
  EXPECT_THROW(rank_and_size(-1, -1), std::invalid_argument);
  RankAndSize given = rank_and_size(1, 3);
  EXPECT_EQ(given.rank, 1);
  EXPECT_EQ(given.world_size, 3);
  EXPECT_THROW(rank_and_size(3, 3), std::invalid_argument);
  ::setenv("RANK", "2", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  RankAndSize env = rank_and_size(-1, -1);
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(rank_and_size(0, -1).rank, 0);
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  ::setenv("SLURM_PROCID", "1", 1);
  ::setenv("SLURM_NTASKS", "2", 1);
  ::setenv("SLURM_STEP_NUM_TASKS", "2", 1);
  ::setenv("SLURM_JOB_ID", "77", 1);
  EXPECT_EQ(rank_and_size(-1, -1).world_size, 2);
}

}  // namespace
}  // namespace ddprpc::rpc
