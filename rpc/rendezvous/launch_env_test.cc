#include "rpc/rendezvous/launch_env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>

namespace ddprpc::rpc {
namespace {

// Every variable launch_env reads, cleared before each test.
const char* const kVars[] = {"RANK",         "WORLD_SIZE",           "LOCAL_RANK",
                             "MASTER_ADDR",  "MASTER_PORT",          "SLURM_PROCID",
                             "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
                             "SLURM_JOB_ID", "SLURM_STEP_NODELIST",  "SLURM_JOB_NODELIST"};

class LaunchEnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kVars) ::unsetenv(v);
  }
  void TearDown() override { SetUp(); }
  static void set(const char* name, const char* value) { ::setenv(name, value, 1); }
  static void slurm_task(const char* procid, const char* ntasks) {
    set("SLURM_PROCID", procid);
    set("SLURM_NTASKS", ntasks);
    set("SLURM_STEP_NUM_TASKS", ntasks);
    set("SLURM_LOCALID", procid);
    set("SLURM_JOB_ID", "4242");
    set("SLURM_JOB_NODELIST", "gpu[07-09,12],cpu1");
  }
};

TEST_F(LaunchEnvTest, NothingSetIsNoRank) {
  const LaunchEnv env = launch_env();
  EXPECT_EQ(env.rank, -1);
  EXPECT_EQ(env.world_size, -1);
  EXPECT_EQ(env.master_addr, "");
  EXPECT_EQ(env.master_port, 0);
  EXPECT_EQ(env.source, "");
}

TEST_F(LaunchEnvTest, TorchrunVariables) {
  set("RANK", "3");
  set("WORLD_SIZE", "8");
  set("LOCAL_RANK", "1");
  set("MASTER_ADDR", "10.0.0.1");
  set("MASTER_PORT", "29500");
  const LaunchEnv env = launch_env();
  EXPECT_EQ(env.source, "torchrun");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
}

TEST_F(LaunchEnvTest, SlurmTaskFindsRankWorldAndFirstHost) {
  slurm_task("2", "5");
  const LaunchEnv env = launch_env();
  EXPECT_EQ(env.source, "slurm");
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 5);
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.master_addr, "gpu07");
  EXPECT_EQ(env.master_port, 20000 + 4242);  // the same on every task of the job
  set("SLURM_STEP_NODELIST", "cpu1,gpu[07-09]");
  EXPECT_EQ(launch_env().master_addr, "cpu1");  // the step's first host
  set("MASTER_PORT", "29600");
  set("MASTER_ADDR", "head");
  EXPECT_EQ(launch_env().master_port, 29600);
  EXPECT_EQ(launch_env().master_addr, "head");
}

TEST_F(LaunchEnvTest, TorchrunWinsOverSlurm) {
  slurm_task("2", "5");
  set("RANK", "0");
  set("WORLD_SIZE", "2");
  const LaunchEnv env = launch_env();
  EXPECT_EQ(env.source, "torchrun");
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 2);
}

TEST_F(LaunchEnvTest, BatchScriptIsNotATask) {
  // sbatch's script has SLURM_PROCID=0 but was not started by srun.
  set("SLURM_PROCID", "0");
  set("SLURM_NTASKS", "5");
  set("SLURM_JOB_NODELIST", "n1");
  const LaunchEnv env = launch_env();
  EXPECT_EQ(env.rank, -1);
  EXPECT_EQ(env.source, "");
}

TEST_F(LaunchEnvTest, MalformedValuesNameTheVariable) {
  set("RANK", "two");
  try {
    launch_env();
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='two'"), std::string::npos) << e.what();
  }
  ::unsetenv("RANK");
  set("MASTER_PORT", "70000");
  EXPECT_THROW(launch_env(), std::invalid_argument);
}

TEST(FirstSlurmHost, HostListForms) {
  EXPECT_EQ(first_slurm_host("node1"), "node1");
  EXPECT_EQ(first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(first_slurm_host("node[01-04]"), "node01");
  EXPECT_EQ(first_slurm_host("node[3,5-7]"), "node3");
  EXPECT_EQ(first_slurm_host("rack[2-3]-n1,x"), "rack2-n1");
  EXPECT_THROW(first_slurm_host("node[1-2"), std::invalid_argument);
}

}  // namespace
}  // namespace ddprpc::rpc
