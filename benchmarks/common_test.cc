// The percentile method both sides of every comparison use (numpy's
// default), the JSON documents every benchmark builds, and the speedups.
#include "benchmarks/common.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "benchmarks/rounds.h"
#include "benchmarks/testing/subprocess.h"
#include "gtest/gtest.h"

namespace ddprpc::benchmarks {
namespace {

TEST(PercentileTest, MatchesNumpysLinearInterpolation) {
  // numpy.percentile([3, 1, 4, 1, 5, 9, 2, 6], [0, 50, 75, 90, 95, 100])
  // = [1.0, 3.5, 5.25, 6.9, 7.95, 9.0] (python3-numpy 1.24).
  const std::vector<double> v = {3, 1, 4, 1, 5, 9, 2, 6};
  const double want[][2] = {{0, 1.0}, {50, 3.5}, {75, 5.25}, {90, 6.9}, {95, 7.95}, {100, 9.0}};
  for (const auto& [pct, value] : want) {
    EXPECT_NEAR(percentile(v, pct / 100), value, 1e-12) << "p" << pct;
    EXPECT_NEAR(testing::numpy_percentile(v, pct), value, 1e-12) << "p" << pct;
  }
  EXPECT_EQ(percentile({7.5}, 0.9), 7.5);
  EXPECT_EQ(percentile({}, 0.5), 0);
  // The median of an even count is the mean of the middle two.
  EXPECT_EQ(percentile({4, 1, 3, 2}, 0.5), 2.5);
}

// This test binary does not link //third_party:tcmalloc: the lookup must
// not name an allocator that is not there (the benchmarks' tests see the
// other side).
TEST(AllocatorNameTest, NamesGlibcWithoutTcmalloc) { EXPECT_EQ(allocator_name(), "glibc malloc"); }

TEST(JsonTest, BuildsTheDocumentInOrderAndReadsBackWhatItWrote) {
  JsonValue sub;
  (*sub.mutable_struct_value()->mutable_fields())["inner"].set_number_value(3);
  Json json;
  json.begin_object();
  json.key("n").value(2).key("s").value("a\"b").key("t").value(true);
  json.key("nan").value(std::nan(""));
  json.key("inf").value(std::numeric_limits<double>::infinity());
  json.key("list").begin_array().value(1).begin_object().key("k").value("v").end_object();
  json.begin_array().end_array().end_array();
  json.key("sub").value(sub);
  json.end_object();

  JsonValue back;
  std::string error;
  ASSERT_TRUE(parse_json(json.str(), &back, &error)) << error << ": " << json.str();
  EXPECT_EQ(json_number(back, {"n"}), 2);
  EXPECT_EQ(json_at(back, {"s"})->string_value(), "a\"b");
  EXPECT_TRUE(json_at(back, {"t"})->bool_value());
  EXPECT_EQ(json_at(back, {"nan"})->kind_case(), JsonValue::kNullValue) << "not finite: null";
  EXPECT_EQ(json_at(back, {"inf"})->kind_case(), JsonValue::kNullValue);
  const auto& list = json_at(back, {"list"})->list_value();
  ASSERT_EQ(list.values_size(), 3);
  EXPECT_EQ(list.values(0).number_value(), 1);
  EXPECT_EQ(json_at(list.values(1), {"k"})->string_value(), "v");
  EXPECT_EQ(list.values(2).list_value().values_size(), 0);
  EXPECT_EQ(json_number(back, {"sub", "inner"}), 3);
  EXPECT_EQ(json_number(back, {"missing"}, -7), -7);
}

TEST(JsonTest, ASecondTopLevelValueReplacesTheFirst) {
  Json json;
  json.value(1);
  json.begin_array().value(2).end_array();
  EXPECT_EQ(json.str(), "[2]");
}

TEST(SpeedupTest, RatesAndTimesAndMissingFigures) {
  EXPECT_DOUBLE_EQ(speedup(200, 100, /*higher_is_better=*/true), 2);
  EXPECT_DOUBLE_EQ(speedup(0.5, 2, /*higher_is_better=*/false), 4);
  EXPECT_EQ(speedup(0, 2, false), 0);
  EXPECT_EQ(speedup(1, -1, true), 0);
  EXPECT_EQ(speedup_cell(1, 3, false), "3.00x");
  EXPECT_EQ(speedup_cell(1, 3, false, 1), "3.0x");
  EXPECT_EQ(speedup_cell(1, 0, false), "-");
}

TEST(SpeedupTest, RoundsArePairedInOrderAndMissingRoundsLeftOut) {
  // Times: PyTorch / ours per round; round 2 has no PyTorch figure, round
  // 4 none of ours.
  const RoundSpeedups r =
      round_speedups({1, 2, 1, 4, 1}, {3, 4, 0, 8}, /*higher_is_better=*/false);
  ASSERT_EQ(r.per_round.size(), 3u);
  EXPECT_DOUBLE_EQ(r.per_round[0], 3);
  EXPECT_DOUBLE_EQ(r.per_round[1], 2);
  EXPECT_DOUBLE_EQ(r.per_round[2], 2);
  EXPECT_DOUBLE_EQ(r.median(), 2);
  EXPECT_EQ(r.list(), "3.00 2.00 2.00");
  const JsonValue j = r.json();
  EXPECT_EQ(json_number(j, {"median"}), 2);
  EXPECT_EQ(json_at(j, {"per_round"})->list_value().values_size(), 3);
}

// Each round runs every variant of ours, then PyTorch's; ratios pair the
// rounds in order.
TEST(RoundsTest, RoundsInterleaveTheSidesAndPairInOrder) {
  RoundsPlan plan;
  plan.name = "test";
  plan.rounds = 3;
  plan.variants = {"a", "b"};
  std::vector<std::string> calls;
  Rounds<double> r;
  const int rc = run_rounds<double>(
      plan,
      [&](const std::string& v, int round, double* f) {
        calls.push_back(v + std::to_string(round));
        *f = v == "a" ? 1.0 + round : 2.0;  // seconds
        return 0;
      },
      [&](int round, double* f) {
        calls.push_back("theirs" + std::to_string(round));
        *f = 4.0;
        return true;
      },
      &r);
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(calls, (std::vector<std::string>{"a0", "b0", "theirs0", "a1", "b1", "theirs1", "a2",
                                             "b2", "theirs2"}));
  auto seconds = [](const double& f) { return f; };
  const RoundSpeedups a = r.speedups("a", seconds, /*higher_is_better=*/false);
  EXPECT_EQ(a.per_round, (std::vector<double>{4.0, 2.0, 4.0 / 3}));
  EXPECT_DOUBLE_EQ(r.speedups("b", seconds, false).median(), 2.0);
  EXPECT_TRUE(r.speedups("c", seconds, false).per_round.empty());
}

// A failure of ours ends the run with its code; one of PyTorch's ends the
// rounds, keeping what was measured; without PyTorch, one round.
TEST(RoundsTest, FailuresEndTheRounds) {
  RoundsPlan plan;
  plan.rounds = 4;
  plan.variants = {"a"};
  int ours_runs = 0;
  Rounds<double> r;
  EXPECT_EQ(run_rounds<double>(
                plan,
                [&](const std::string&, int round, double* f) {
                  ++ours_runs;
                  *f = 1;
                  return round == 1 ? 7 : 0;
                },
                [](int, double* f) { return (*f = 2), true; }, &r),
            7);
  EXPECT_EQ(ours_runs, 2);
  EXPECT_EQ(r.theirs.size(), 1u);

  Rounds<double> r2;
  EXPECT_EQ(run_rounds<double>(
                plan, [](const std::string&, int, double* f) { return (*f = 1), 0; },
                [](int round, double* f) { return (*f = 2), round < 2; }, &r2),
            0);
  EXPECT_EQ(r2.ours["a"].size(), 3u);  // the third round's PyTorch failed: no fourth
  EXPECT_EQ(r2.theirs.size(), 2u);
  EXPECT_EQ(r2.speedups("a", [](const double& f) { return f; }, false).per_round.size(), 2u);

  plan.with_theirs = false;
  Rounds<double> r3;
  int theirs_runs = 0;
  EXPECT_EQ(run_rounds<double>(
                plan, [](const std::string&, int, double* f) { return (*f = 1), 0; },
                [&](int, double*) { return ++theirs_runs, true; }, &r3),
            0);
  EXPECT_EQ(r3.ours["a"].size(), 1u);
  EXPECT_EQ(theirs_runs, 0);
}

}  // namespace
}  // namespace ddprpc::benchmarks
