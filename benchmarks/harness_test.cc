// run_roles with this test binary as the benchmark: its ranks (main() below,
// told what to do by --role=...) write results or fail in the ways a
// benchmark's ranks can, and the launcher gets back the one result, parsed,
// with how the processes ended; nothing is left behind.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "benchmarks/harness.h"
#include "gtest/gtest.h"

namespace bench = ddprpc::benchmarks;

namespace {

int g_argc;
char** g_argv;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

int rank() { return std::atoi(env("RANK").c_str()); }

// A rank: does what --role=<role> says.
int role_main(int argc, char** argv) {
  std::string role;
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    args.push_back(argv[i]);
    if (absl::StartsWith(argv[i], "--role=")) role = std::string(argv[i]).substr(7);
  }
  if (role == "write") {
    // Rank 1 answers with what it saw; the others write nothing.
    if (rank() != 1) return 0;
    bench::Json json;
    json.begin_object().key("rank").value(rank());
    json.key("world_size").value(std::atoi(env("WORLD_SIZE").c_str()));
    json.key("variable").value(env("HARNESS_TEST_VARIABLE"));
    json.key("args").begin_array();
    for (const auto& a : args) json.value(a);
    json.end_array().end_object();
    return bench::write_result(json) ? 0 : 1;
  }
  if (role == "twice") {
    bench::JsonValue v;
    (*v.mutable_struct_value()->mutable_fields())["n"].set_number_value(1);
    if (!bench::write_result(v)) return 1;
    (*v.mutable_struct_value()->mutable_fields())["n"].set_number_value(2);
    return bench::write_result(v) ? 0 : 1;
  }
  if (role == "fail") {
    // The result written before failing still comes back.
    if (rank() != 0) return 0;
    bench::Json json;
    json.begin_object().key("partial").value(true).end_object();
    bench::write_result(json);
    return 3;
  }
  if (role == "garbage") {
    // Text that is not JSON where the result goes (every writer of the
    // harness writes JSON).
    std::ofstream(env("DDPRPC_BENCHMARK_RESULT_FILE")) << "{\"unfinished\":";
    return 0;
  }
  if (role == "hang") {
    // Leaves its pid where the test looks, then never ends.
    std::ofstream(absl::StrCat(env("TEST_TMPDIR"), "/hang.", rank(), ".pid")) << ::getpid();
    for (;;) ::pause();
  }
  return 0;  // "none": no result
}

bench::RolesOptions roles(int nprocs, const std::string& role) {
  bench::RolesOptions o;
  o.nprocs = nprocs;
  o.args = {"--role=" + role};
  o.timeout = absl::Seconds(60);
  return o;
}

// Result files of this process left in the temporary directory.
std::vector<std::string> leftovers() {
  const std::filesystem::path dir = std::filesystem::path(bench::temp_path("x")).parent_path();
  const std::string mine = absl::StrCat(".", ::getpid());
  std::vector<std::string> out;
  std::error_code ignored;
  for (const auto& e : std::filesystem::directory_iterator(dir, ignored)) {
    const std::string name = e.path().filename().string();
    if (absl::StartsWith(name, "ddprpc_result.") && absl::StrContains(name, mine)) out.push_back(name);
  }
  return out;
}

TEST(HarnessTest, OneRanksResultComesBackParsed) {
  bench::RolesOptions o = roles(3, "write");
  o.args.push_back("--extra=1");
  o.env = {{"HARNESS_TEST_VARIABLE", "seen"}};
  const bench::RolesResult r = bench::run_roles(g_argc, g_argv, o);
  ASSERT_TRUE(r.ok()) << r.message << " " << r.result_error;
  EXPECT_EQ(bench::json_number(r.result, {"rank"}), 1);
  EXPECT_EQ(bench::json_number(r.result, {"world_size"}), 3);
  const bench::JsonValue* variable = bench::json_at(r.result, {"variable"});
  ASSERT_NE(variable, nullptr);
  EXPECT_EQ(variable->string_value(), "seen");
  // This binary's own arguments first, then the options' ones.
  const bench::JsonValue* args = bench::json_at(r.result, {"args"});
  ASSERT_NE(args, nullptr);
  std::vector<std::string> got;
  for (const auto& a : args->list_value().values()) got.push_back(a.string_value());
  ASSERT_GE(got.size(), 2u);
  EXPECT_EQ(got[got.size() - 2], "--role=write");
  EXPECT_EQ(got.back(), "--extra=1");
  EXPECT_TRUE(leftovers().empty());
}

TEST(HarnessTest, TheLastWriteWins) {
  const bench::RolesResult r = bench::run_roles(g_argc, g_argv, roles(1, "twice"));
  ASSERT_TRUE(r.ok()) << r.message << " " << r.result_error;
  EXPECT_EQ(bench::json_number(r.result, {"n"}), 2);
}

TEST(HarnessTest, AFailedRankIsNamedAndItsResultStillComesBack) {
  const bench::RolesResult r = bench::run_roles(g_argc, g_argv, roles(2, "fail"));
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.failed_rank, 0);
  EXPECT_FALSE(r.timed_out);
  ASSERT_TRUE(r.has_result) << r.result_error;
  const bench::JsonValue* partial = bench::json_at(r.result, {"partial"});
  ASSERT_NE(partial, nullptr);
  EXPECT_TRUE(partial->bool_value());
  EXPECT_TRUE(leftovers().empty());
}

TEST(HarnessTest, NoResultOrOneThatIsNotJsonIsSaid) {
  const bench::RolesResult none = bench::run_roles(g_argc, g_argv, roles(2, "none"));
  EXPECT_EQ(none.exit_code, 0);
  EXPECT_FALSE(none.has_result);
  EXPECT_FALSE(none.ok());
  EXPECT_TRUE(none.result.has_null_value());
  EXPECT_NE(none.result_error.find("no rank wrote a result"), std::string::npos) << none.result_error;

  const bench::RolesResult garbage = bench::run_roles(g_argc, g_argv, roles(1, "garbage"));
  EXPECT_EQ(garbage.exit_code, 0);
  EXPECT_FALSE(garbage.has_result);
  EXPECT_NE(garbage.result_error.find("not JSON"), std::string::npos) << garbage.result_error;
  EXPECT_TRUE(leftovers().empty());
}

TEST(HarnessTest, ATimeoutStopsEveryRank) {
  bench::RolesOptions o = roles(2, "hang");
  o.timeout = absl::Seconds(5);
  const absl::Time start = absl::Now();
  const bench::RolesResult r = bench::run_roles(g_argc, g_argv, o);
  EXPECT_LT(absl::Now() - start, absl::Seconds(40));
  EXPECT_TRUE(r.timed_out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_FALSE(r.has_result);
  for (int rank = 0; rank < 2; ++rank) {
    const std::string path = absl::StrCat(env("TEST_TMPDIR"), "/hang.", rank, ".pid");
    std::ifstream in(path);
    int pid = 0;
    ASSERT_TRUE(in >> pid) << "rank " << rank << " never started";
    // Gone (reaped by the launcher), not merely signalled.
    EXPECT_TRUE(::kill(pid, 0) != 0 && errno == ESRCH) << "rank " << rank << " still runs";
  }
}

TEST(HarnessTest, WritingOutsideARankIsRefused) {
  EXPECT_FALSE(bench::started_by_run_roles());
  std::string error;
  bench::Json json;
  json.begin_object().end_object();
  EXPECT_FALSE(bench::write_result(json, &error));
  EXPECT_NE(error, "");
}

}  // namespace

int main(int argc, char** argv) {
  if (bench::started_by_run_roles()) return role_main(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  g_argc = argc;
  g_argv = argv;
  return RUN_ALL_TESTS();
}
