// Runs //benchmarks:ddp_rpc as a user would (a subprocess): a small run
// prints a parsable table and JSON; killing a parameter server mid-run makes
// it fail promptly with a message naming the server and the call, leaving
// no process behind.
#include <signal.h>

#include <cstdlib>
#include <regex>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "benchmarks/testing/subprocess.h"
#include "gtest/gtest.h"

namespace {

using namespace ddprpc::benchmarks::testing;

const std::string kBinary = "benchmarks/ddp_rpc";

TEST(DdpRpcBenchmarkTest, SmallRunPrintsTableAndJson) {
  const std::string json = absl::StrCat(std::getenv("TEST_TMPDIR"), "/small.json");
  Child c(binary(kBinary),
          {"--trainers=2", "--ps=2", "--iters=3", "--warmup=1", "--pytorch=false", "--json=" + json},
          "small");
  ASSERT_EQ(c.wait_for(absl::Minutes(3)), 0) << c.err();
  const std::string out = c.out();
  std::regex row(R"((Trainer0|Trainer1|All):\s+p50: ([0-9.]+)s\s+([0-9]+)/s\s+p75: ([0-9.]+)s\s+([0-9]+)/s\s+p90: ([0-9.]+)s\s+([0-9]+)/s\s+p95: ([0-9.]+)s\s+([0-9]+)/s)");
  int rows = 0;
  for (std::sregex_iterator it(out.begin(), out.end(), row), end; it != end; ++it, ++rows) {
    for (int g = 2; g <= 9; ++g) EXPECT_GT(std::stod((*it)[g].str()), 0) << (*it)[0];
  }
  EXPECT_EQ(rows, 3) << out;
  const std::string j = read_file(json);
  for (const char* key : {"\"trainer0\"", "\"trainer1\"", "\"all\"", "\"config\"", "\"trainers\":2"}) {
    EXPECT_NE(j.find(key), std::string::npos) << key << " missing from " << j;
  }
}

TEST(DdpRpcBenchmarkTest, KilledParameterServerFailsTheRunCleanly) {
  Child c(binary(kBinary),
          {"--trainers=2", "--ps=2", "--iters=500", "--warmup=0", "--pytorch=false",
           "--json=" + absl::StrCat(std::getenv("TEST_TMPDIR"), "/killed.json")},
          "killed");
  // Wait until training runs, then kill ps0 (rank 2 = trainers + 0).
  absl::Time deadline = absl::Now() + absl::Minutes(2);
  while (c.err().find("iteration 2/") == std::string::npos && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  pid_t ps0 = find_rank("killed", 2);
  ASSERT_GT(ps0, 0) << "ps0 not found; benchmark stderr:\n" << tail(c.err());
  absl::Time killed = absl::Now();
  kill(ps0, SIGKILL);
  int code = c.wait_for(absl::Seconds(90));
  EXPECT_NE(code, 0);
  EXPECT_NE(code, -1) << "the benchmark hung after a parameter server died";
  EXPECT_LT(absl::Now() - killed, absl::Seconds(60));
  const std::string err = c.err();
  // e.g. "rref.rpc('ddprpc.models.EmbeddingTable.forward') on worker 'ps0' failed"
  EXPECT_TRUE(std::regex_search(err, std::regex(R"(\('[A-Za-z_.]+'\) on worker 'ps0' failed)")))
      << tail(err);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_TRUE(run_processes("killed").empty()) << "orphaned benchmark processes";
}

}  // namespace
