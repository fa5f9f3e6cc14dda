// Runs //benchmarks:rpc_rl as a user would: small runs with batch on and off
// print a table that parses, write valid JSON, answer every request with one
// valid action (the binary exits non-zero otherwise), and chart.
#include <cstdlib>
#include <regex>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "benchmarks/testing/subprocess.h"
#include "gtest/gtest.h"

namespace {

using namespace ddprpc::benchmarks::testing;

// Rows of the table: "<x> <16 numbers>".
int check_table(const std::string& out, const std::vector<std::string>& xs) {
  int rows = 0;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    std::vector<std::string> cells = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (cells.size() != 17 || cells[0] != xs[rows % xs.size()]) continue;
    for (size_t i = 1; i < cells.size(); ++i) {
      EXPECT_GT(std::stod(cells[i]), 0) << line;
    }
    // Percentiles rise within latency metrics.
    EXPECT_LE(std::stod(cells[1]), std::stod(cells[4])) << line;
    EXPECT_LE(std::stod(cells[9]), std::stod(cells[12])) << line;
    ++rows;
  }
  return rows;
}

void run(bool batch) {
  const std::string tag = batch ? "batch" : "nobatch";
  const std::string json = test_tmp(tag + ".json");
  Child c(binary("benchmarks/rpc_rl"),
          {"--world_size=3,4", absl::StrCat("--batch=", batch ? "true" : "false"),
           "--episodes=2", "--episode_steps=5", "--pytorch=false", "--output_file_path=" + json},
          tag);
  ASSERT_EQ(c.wait_for(absl::Minutes(3)), 0) << tail(c.err());
  EXPECT_EQ(check_table(c.out(), {"3", "4"}), 2) << c.out();
  JsonValue report;
  std::string error;
  ASSERT_TRUE(parse_json(read_file(json), &report, &error)) << error;
  const std::string j = to_json(report);
  // Every request answered, every action valid: (world_size - 2) * 2 * 5.
  const JsonValue* results = json_at(report, {"benchmark_results"});
  ASSERT_NE(results, nullptr) << j;
  ASSERT_EQ(results->list_value().values_size(), 2) << j;
  for (int i = 0; i < 2; ++i) {
    const JsonValue& r = results->list_value().values(i);
    const double expected = (i + 1) * 2 * 5;
    ASSERT_NE(json_at(r, {"world_size"}), nullptr) << j;
    EXPECT_EQ(json_at(r, {"world_size"})->string_value(), i == 0 ? "3" : "4") << j;
    EXPECT_EQ(json_number(r, {"requests"}), expected) << j;
    EXPECT_EQ(json_number(r, {"answered"}), expected) << j;
    EXPECT_EQ(json_number(r, {"valid_actions"}), expected) << j;
    EXPECT_GT(json_number(r, {"agent throughput", "p50"}), 0) << j;
  }
  ASSERT_NE(json_at(report, {"x_axis_name"}), nullptr) << j;
  EXPECT_EQ(json_at(report, {"x_axis_name"})->string_value(), "world_size") << j;
  ASSERT_NE(json_at(report, {"pytorch"}), nullptr) << j;
  EXPECT_EQ(json_at(report, {"pytorch"})->kind_case(), JsonValue::kNullValue) << j;
  // The plot script reads it (skipped where matplotlib is missing).
  if (std::system("/usr/bin/python3 -c 'import matplotlib' 2>/dev/null") == 0) {
    const std::string png = test_tmp(tag + ".png");
    const std::string cmd = absl::StrCat("/usr/bin/python3 ", binary("benchmarks/reference/plot_rl.py"),
                                         " ", json, " ", png);
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    EXPECT_GT(read_file(png).size(), 1000u);
  }
}

TEST(RpcRlBenchmarkTest, BatchAnswersEveryRequest) { run(true); }
TEST(RpcRlBenchmarkTest, NonBatchAnswersEveryRequest) { run(false); }

TEST(RpcRlBenchmarkTest, RejectsTwoListFlags) {
  Child c(binary("benchmarks/rpc_rl"), {"--world_size=3,4", "--nlayers=1,2", "--pytorch=false"},
          "twolists");
  EXPECT_EQ(c.wait_for(absl::Seconds(30)), 2);
  EXPECT_NE(c.err().find("only one flag may hold a comma list"), std::string::npos) << c.err();
}

}  // namespace
