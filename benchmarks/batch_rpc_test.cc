// Runs //benchmarks:batch_rpc as a user would (a subprocess), in small
// configurations: its tables parse, its JSON is valid, every request (a
// trainer's gradients, an observer's state, batched or not) gets exactly one
// answer, async execution holds no callee thread while trainers wait, and
// REINFORCE's reward improves over episodes for the default seed.
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "benchmarks/testing/subprocess.h"
#include "gtest/gtest.h"

namespace {

using ddprpc::benchmarks::testing::binary;
using ddprpc::benchmarks::testing::json_at;
using ddprpc::benchmarks::testing::json_number;
using ddprpc::benchmarks::testing::JsonValue;
using ddprpc::benchmarks::testing::parse_json;
using ddprpc::benchmarks::testing::Child;
using ddprpc::benchmarks::testing::read_file;
using ddprpc::benchmarks::testing::run_processes;
using ddprpc::benchmarks::testing::tail;
using ddprpc::benchmarks::testing::to_json;
using ddprpc::benchmarks::testing::test_tmp;

// The JSON file the benchmark wrote, parsed (a failed assertion if it is not JSON).
JsonValue read_json(const std::string& path) {
  JsonValue v;
  std::string error;
  const std::string text = read_file(path);
  EXPECT_TRUE(parse_json(text, &v, &error)) << error << "\n" << text;
  return v;
}

// The array at `key` of the top-level object (empty if missing).
std::vector<JsonValue> json_array(const JsonValue& v, const std::string& key) {
  const JsonValue* a = json_at(v, {key});
  if (a == nullptr) return {};
  return {a->list_value().values().begin(), a->list_value().values().end()};
}

// Runs the benchmark to completion; its stdout, or "" after a failed assertion.
std::string run(const std::vector<std::string>& args, const std::string& tag) {
  Child c(binary("benchmarks/batch_rpc"), args, tag);
  const int code = c.wait_for(absl::Minutes(4));
  EXPECT_EQ(code, 0) << "batch_rpc " << tag << " stderr:\n" << tail(c.err());
  EXPECT_TRUE(run_processes(tag).empty()) << "processes left behind";
  return code == 0 ? c.out() : "";
}

TEST(BatchRpcBenchmarkTest, ParameterServerAnswersEveryTrainerAndHoldsNoThread) {
  const std::string json = test_tmp("ps.json");
  const int iters = 3, warmup = 1;
  const std::string out =
      run({"--mode=ps", "--trainers=2,3", absl::StrCat("--iters=", iters),
           absl::StrCat("--warmup=", warmup), "--pytorch=false", "--json=" + json},
          "ps");
  ASSERT_FALSE(out.empty());
  // trainers, mode, updates/s, grads/s, blocked mean, max, busy mean, max, requests/answers
  std::regex row(R"((\d+) +(async execution|blocking) +([0-9.]+) +([0-9.]+) +([0-9.]+) +(\d+) +)"
                 R"(([0-9.]+) +(\d+) +(\d+)/(\d+)\n)");
  int rows = 0;
  for (std::sregex_iterator it(out.begin(), out.end(), row), end; it != end; ++it, ++rows) {
    const auto& m = *it;
    const int trainers = std::stoi(m[1].str());
    const bool async = m[2].str() == "async execution";
    EXPECT_GT(std::stod(m[3].str()), 0) << m[0];
    EXPECT_NEAR(std::stod(m[4].str()), trainers * std::stod(m[3].str()), 0.2) << m[0];
    const double blocked_mean = std::stod(m[5].str());
    if (async) {
      // Waiting trainers hold no callee thread; an RRef fork message may
      // be running at the moment of a sample.
      EXPECT_LE(blocked_mean, 1.0) << m[0];
    } else {
      EXPECT_GE(blocked_mean, trainers - 1) << m[0];
    }
    // Every gradient report was answered once with the updated model.
    EXPECT_EQ(std::stoi(m[9].str()), trainers * (iters + warmup)) << m[0];
    EXPECT_EQ(m[9].str(), m[10].str()) << m[0];
  }
  EXPECT_EQ(rows, 4) << out;
  const std::vector<JsonValue> entries = json_array(read_json(json), "ps");
  EXPECT_EQ(entries.size(), 4u);
  for (const JsonValue& e : entries) {
    const std::string where = to_json(e);
    const double trainers = json_number(e, {"trainers"});
    EXPECT_TRUE(trainers == 2 || trainers == 3) << where;
    // Counted here: one gradient report per trainer per iteration.
    const double expected = trainers * (iters + warmup);
    EXPECT_EQ(json_number(e, {"expected"}), expected) << where;
    EXPECT_EQ(json_number(e, {"requests"}), expected) << where;
    EXPECT_EQ(json_number(e, {"answers"}), expected) << where;
    EXPECT_EQ(json_number(e, {"models_received"}), expected) << where;
    EXPECT_EQ(json_number(e, {"updates"}), iters + warmup) << where;
  }
}

struct CartPoleRow {
  int world = 0;
  double batch_s = 0, nobatch_s = 0;
  double batch_first = 0, batch_second = 0, nobatch_first = 0, nobatch_second = 0;
  long batch_req = 0, batch_ans = 0, nobatch_req = 0, nobatch_ans = 0;
};

std::vector<CartPoleRow> cartpole_rows(const std::string& out) {
  std::regex row(R"((\d+) +([0-9.]+) +([0-9.]+) +([0-9.]+)x +([0-9.]+) -> ([0-9.]+) +)"
                 R"(([0-9.]+) -> ([0-9.]+) +(\d+)/(\d+) +(\d+)/(\d+)\n)");
  std::vector<CartPoleRow> rows;
  for (std::sregex_iterator it(out.begin(), out.end(), row), end; it != end; ++it) {
    const auto& m = *it;
    CartPoleRow r;
    r.world = std::stoi(m[1].str());
    r.batch_s = std::stod(m[2].str());
    r.nobatch_s = std::stod(m[3].str());
    r.batch_first = std::stod(m[5].str());
    r.batch_second = std::stod(m[6].str());
    r.nobatch_first = std::stod(m[7].str());
    r.nobatch_second = std::stod(m[8].str());
    r.batch_req = std::stol(m[9].str());
    r.batch_ans = std::stol(m[10].str());
    r.nobatch_req = std::stol(m[11].str());
    r.nobatch_ans = std::stol(m[12].str());
    rows.push_back(r);
  }
  return rows;
}

TEST(BatchRpcBenchmarkTest, CartPoleAnswersEveryObserverOnceWithAndWithoutBatching) {
  const std::string json = test_tmp("cartpole.json");
  const int episodes = 2, steps = 30;
  const std::string out = run({"--mode=cartpole", "--world_sizes=3..4",
                               absl::StrCat("--episodes=", episodes), absl::StrCat("--steps=", steps),
                               "--pytorch=false", "--json=" + json},
                              "cartpole");
  ASSERT_FALSE(out.empty());
  std::vector<CartPoleRow> rows = cartpole_rows(out);
  ASSERT_EQ(rows.size(), 2u) << out;
  for (const auto& r : rows) {
    EXPECT_EQ(r.world, &r == &rows[0] ? 3 : 4);
    EXPECT_GT(r.batch_s, 0);
    EXPECT_GT(r.nobatch_s, 0);
    // One request per observer per step, each answered with one action.
    const long expected = static_cast<long>(r.world - 1) * steps * episodes;
    EXPECT_EQ(r.batch_req, expected);
    EXPECT_EQ(r.batch_ans, expected);
    EXPECT_EQ(r.nobatch_req, expected);
    EXPECT_EQ(r.nobatch_ans, expected);
    for (double reward : {r.batch_first, r.batch_second, r.nobatch_first, r.nobatch_second}) {
      EXPECT_GE(reward, 1);
      EXPECT_LE(reward, steps);
    }
  }
  // The seed's "world_size, batch, no-batch" lines.
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(\n3, [0-9.]+, [0-9.]+\n4, [0-9.]+, [0-9.]+\n)")))
      << out;
  const std::vector<JsonValue> worlds = json_array(read_json(json), "cartpole");
  EXPECT_EQ(worlds.size(), 2u);
  for (const JsonValue& w : worlds) {
    for (const char* mode : {"batch", "nobatch"}) {
      const std::string where = std::string(mode) + " in " + to_json(w);
      const double world = json_number(w, {"world_size"});
      EXPECT_TRUE(world == 3 || world == 4) << where;
      // Counted here: one request per observer (world - 1) per step and episode.
      const double expected = (world - 1) * steps * episodes;
      EXPECT_EQ(json_number(w, {mode, "expected"}), expected) << where;
      EXPECT_EQ(json_number(w, {mode, "requests"}), expected) << where;
      EXPECT_EQ(json_number(w, {mode, "answers"}), expected) << where;
      EXPECT_EQ(json_number(w, {mode, "actions_received"}), expected) << where;
    }
  }
}

TEST(BatchRpcBenchmarkTest, ReinforceRewardImprovesForTheDefaultSeed) {
  // Runs are reproducible for a seed (seeded environments, policy and
  // sampling generators), so this checks one fixed trajectory per mode.
  const std::string out = run({"--mode=cartpole", "--world_sizes=3", "--episodes=10", "--steps=100",
                               "--seed=543", "--pytorch=false", "--json=" + test_tmp("learning.json")},
                              "learning");
  ASSERT_FALSE(out.empty());
  std::vector<CartPoleRow> rows = cartpole_rows(out);
  ASSERT_EQ(rows.size(), 1u) << out;
  EXPECT_GT(rows[0].batch_second, rows[0].batch_first * 1.2) << out;
  EXPECT_GT(rows[0].nobatch_second, rows[0].nobatch_first * 1.2) << out;
}

TEST(BatchRpcBenchmarkTest, PytorchsSideRunsWithTheSameConfigurationAndGivesRatios) {
  const std::string json = test_tmp("pytorch.json");
  const std::string out = run({"--mode=all", "--trainers=2", "--iters=3", "--warmup=1",
                               "--world_sizes=2", "--episodes=2", "--steps=5", "--blocking=false",
                               "--json=" + json},
                              "pytorch");
  ASSERT_FALSE(out.empty());
  EXPECT_NE(out.find("PyTorch (same machine, same run)"), std::string::npos) << out;
  JsonValue report;
  ASSERT_TRUE(parse_json(read_file(json), &report)) << read_file(json);
  ASSERT_NE(json_at(report, {"pytorch"}), nullptr) << read_file(json);
  const std::vector<JsonValue> ps = json_array(*json_at(report, {"pytorch"}), "ps");
  ASSERT_EQ(ps.size(), 1u) << read_file(json);
  EXPECT_EQ(json_number(ps[0], {"trainers"}), 2);
  EXPECT_GT(json_number(ps[0], {"updates_per_s"}), 0);
  EXPECT_GT(json_number(ps[0], {"ddprpc_vs_pytorch"}), 0);
  const std::vector<JsonValue> cartpole = json_array(*json_at(report, {"pytorch"}), "cartpole");
  ASSERT_EQ(cartpole.size(), 1u) << read_file(json);
  EXPECT_EQ(json_number(cartpole[0], {"world_size"}), 2);
  EXPECT_GT(json_number(cartpole[0], {"batch_s"}), 0);
  EXPECT_GT(json_number(cartpole[0], {"nobatch_s"}), 0);
}

TEST(BatchRpcBenchmarkTest, RejectsAnUnknownMode) {
  Child c(binary("benchmarks/batch_rpc"), {"--mode=bogus"}, "bogus");
  EXPECT_EQ(c.wait_for(absl::Seconds(30)), 2);
  EXPECT_NE(c.err().find("--mode must be ps, cartpole or all"), std::string::npos) << c.err();
}

}  // namespace
