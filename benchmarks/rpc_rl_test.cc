// Runs //benchmarks:rpc_rl as a user would: small runs with batch on and off
// answer every request with one valid action (the binary exits non-zero
// otherwise), print a table of the JSON's figures, and every figure follows
// from the raw samples in the JSON (recomputed here); the JSON charts.
#include <cstdlib>
#include <regex>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "benchmarks/testing/subprocess.h"
#include "gtest/gtest.h"

namespace {

using namespace ddprpc::benchmarks::testing;

const char* const kMetrics[] = {"agent latency (seconds)", "agent throughput",
                                "observer latency (seconds)", "observer throughput"};
const int kPercentiles[] = {50, 75, 90, 95};

// One result of ours against its raw samples: `requests` observer samples;
// agent samples one per batch (batch) or per request; throughputs are
// batch size / latency; every percentile is numpy's of its samples.
void expect_figures_from_samples(const JsonValue& r, bool batch, int observers, int requests,
                                 const std::string& where) {
  std::vector<std::vector<double>> samples;
  for (const char* metric : kMetrics) samples.push_back(json_numbers(r, {"samples", metric}));
  const size_t agent_samples = batch ? requests / observers : requests;
  EXPECT_EQ(samples[0].size(), agent_samples) << where;
  EXPECT_EQ(samples[1].size(), agent_samples) << where;
  EXPECT_EQ(samples[2].size(), static_cast<size_t>(requests)) << where;
  EXPECT_EQ(samples[3].size(), static_cast<size_t>(requests)) << where;
  for (int m = 0; m < 4; m += 2) {
    const double per_sample = m == 0 && batch ? observers : 1;
    for (size_t i = 0; i < samples[m].size() && i < samples[m + 1].size(); ++i) {
      EXPECT_GT(samples[m][i], 0) << where;
      EXPECT_NEAR(samples[m + 1][i], per_sample / samples[m][i], 1e-4 * samples[m + 1][i])
          << where << " " << kMetrics[m + 1] << " sample " << i;
    }
  }
  for (int m = 0; m < 4; ++m) {
    for (int p : kPercentiles) {
      const double want = numpy_percentile(samples[m], p);
      EXPECT_NEAR(json_number(r, {kMetrics[m], absl::StrCat("p", p)}), want, 1e-4 * want)
          << where << " " << kMetrics[m] << " p" << p;
    }
  }
}

// The table's rows ("<x> <16 numbers>") print the JSON's figures (latencies
// to 5 decimals, throughputs to units). Returns the rows found.
int check_table(const std::string& out, const std::vector<std::string>& xs, const JsonValue& results) {
  int rows = 0;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    std::vector<std::string> cells = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (rows >= static_cast<int>(xs.size()) || cells.size() != 17 || cells[0] != xs[rows]) continue;
    const JsonValue& r = results.list_value().values(rows);
    for (int m = 0; m < 4; ++m) {
      for (int p = 0; p < 4; ++p) {
        const double printed = std::stod(cells[1 + 4 * m + p]);
        const double figure = json_number(r, {kMetrics[m], absl::StrCat("p", kPercentiles[p])});
        EXPECT_NEAR(printed, figure, m % 2 == 0 ? 6e-6 : 0.6) << line << ": " << kMetrics[m];
      }
    }
    ++rows;
  }
  return rows;
}

// `policy`: the flag choosing the agent's policy, and `label` what the
// output calls it.
void run(bool batch, const std::string& policy, const std::string& label) {
  const std::string tag = absl::StrCat(batch ? "batch" : "nobatch", label.size());
  const std::string json = test_tmp(tag + ".json");
  Child c(binary("benchmarks/rpc_rl"),
          {"--world_size=3,4", absl::StrCat("--batch=", batch ? "true" : "false"),
           "--episodes=2", "--episode_steps=5", "--pytorch=false", "--output_file_path=" + json,
           policy},
          tag);
  ASSERT_EQ(c.wait_for(absl::Minutes(3)), 0) << tail(c.err());
  JsonValue report;
  std::string error;
  ASSERT_TRUE(parse_json(read_file(json), &report, &error)) << error;
  const std::string j = to_json(report);
  // Every request answered, every action valid: (world_size - 2) * 2 * 5.
  const JsonValue* results = json_at(report, {"benchmark_results"});
  ASSERT_NE(results, nullptr) << j;
  ASSERT_EQ(results->list_value().values_size(), 2) << j;
  EXPECT_EQ(check_table(c.out(), {"3", "4"}, *results), 2) << c.out();
  EXPECT_NE(c.out().find("policy on " + label), std::string::npos) << c.out();
  for (int i = 0; i < 2; ++i) {
    const JsonValue& r = results->list_value().values(i);
    const double expected = (i + 1) * 2 * 5;
    ASSERT_NE(json_at(r, {"world_size"}), nullptr) << j;
    EXPECT_EQ(json_at(r, {"world_size"})->string_value(), i == 0 ? "3" : "4") << j;
    EXPECT_EQ(json_number(r, {"requests"}), expected) << j;
    EXPECT_EQ(json_number(r, {"answered"}), expected) << j;
    EXPECT_EQ(json_number(r, {"valid_actions"}), expected) << j;
    expect_figures_from_samples(r, batch, i + 1, static_cast<int>(expected),
                                absl::StrCat(tag, " world_size ", i + 3));
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

TEST(RpcRlBenchmarkTest, BatchAnswersEveryRequest) { run(true, "--dense_kernel=xnnpack", "xnnpack"); }
TEST(RpcRlBenchmarkTest, NonBatchAnswersEveryRequest) { run(false, "--dense_kernel=aten", "aten"); }
// The agent's policy compiled (//models:policy_compile), both modes.
TEST(RpcRlBenchmarkTest, CompiledPolicyAnswersEveryRequest) {
  run(true, "--compile=torchscript/freeze", "compiled:torchscript/freeze");
  run(false, "--compile=torchscript/optimize", "compiled:torchscript/optimize");
}

TEST(RpcRlBenchmarkTest, RejectsTwoListFlags) {
  Child c(binary("benchmarks/rpc_rl"), {"--world_size=3,4", "--nlayers=1,2", "--pytorch=false"},
          "twolists");
  EXPECT_EQ(c.wait_for(absl::Seconds(30)), 2);
  EXPECT_NE(c.err().find("only one flag may hold a comma list"), std::string::npos) << c.err();
}

TEST(RpcRlBenchmarkTest, RejectsAnUnknownCompileBackend) {
  Child c(binary("benchmarks/rpc_rl"), {"--compile=bogus", "--pytorch=false"}, "badcompile");
  EXPECT_EQ(c.wait_for(absl::Seconds(30)), 2);
  EXPECT_NE(c.err().find("--compile: unknown backend/mode 'bogus'"), std::string::npos) << c.err();
}

}  // namespace
