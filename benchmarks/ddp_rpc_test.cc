// Runs //benchmarks:ddp_rpc as a user would (a subprocess): a small run
// prints a parsable table and JSON; killing a parameter server mid-run makes
// it fail promptly with a message naming the server and the call, leaving
// no process behind.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace {

std::string binary() {
  return absl::StrCat(std::getenv("TEST_SRCDIR"), "/ddprpc/benchmarks/ddp_rpc");
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Child {
  pid_t pid = -1;
  std::string out_path, err_path;
  // A failed assertion must not leave the benchmark running: its ranks die
  // with the coordinator (PR_SET_PDEATHSIG).
  ~Child() {
    if (pid > 0 && waitpid(pid, nullptr, WNOHANG) == 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
};

std::string tail(const std::string& s) { return s.size() > 3000 ? s.substr(s.size() - 3000) : s; }

Child start(const std::vector<std::string>& args, const std::string& tag) {
  Child c;
  c.out_path = absl::StrCat(std::getenv("TEST_TMPDIR"), "/", tag, ".out");
  c.err_path = absl::StrCat(std::getenv("TEST_TMPDIR"), "/", tag, ".err");
  c.pid = fork();
  if (c.pid == 0) {
    // Marks this run's processes (the ranks inherit it).
    setenv("DDPRPC_TEST_RUN", absl::StrCat(getppid(), "-", tag).c_str(), 1);
    int out = open(c.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = open(c.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(out, 1);
    dup2(err, 2);
    std::vector<char*> argv;
    std::string bin = binary();
    argv.push_back(bin.data());
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return c;
}

// Waits up to `timeout`; returns the exit code, or -1 (and kills it) on timeout.
int wait_for(Child& c, absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int status;
    if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
      c.pid = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return -1;  // still running; ~Child kills it
}

std::vector<std::string> environment(pid_t pid) {
  std::vector<std::string> vars;
  std::istringstream in(read_file(absl::StrCat("/proc/", pid, "/environ")));
  for (std::string var; std::getline(in, var, '\0');) vars.push_back(var);
  return vars;
}

// Live processes of the run started with `tag` by this test.
std::vector<pid_t> run_processes(const std::string& tag) {
  const std::string marker = absl::StrCat("DDPRPC_TEST_RUN=", getpid(), "-", tag);
  std::vector<pid_t> out;
  for (int pid = 2; pid < 4194304; ++pid) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d", pid);
    if (access(path, F_OK) != 0) continue;
    for (const auto& var : environment(pid)) {
      if (var == marker) out.push_back(pid);
    }
  }
  return out;
}

pid_t find_rank(const std::string& tag, int rank) {
  for (pid_t pid : run_processes(tag)) {
    for (const auto& var : environment(pid)) {
      if (var == absl::StrCat("RANK=", rank)) return pid;
    }
  }
  return -1;
}

TEST(DdpRpcBenchmarkTest, SmallRunPrintsTableAndJson) {
  const std::string json = absl::StrCat(std::getenv("TEST_TMPDIR"), "/small.json");
  Child c = start({"--trainers=2", "--ps=2", "--iters=3", "--warmup=1", "--pytorch=false",
                   "--json=" + json},
                  "small");
  ASSERT_EQ(wait_for(c, absl::Minutes(3)), 0) << read_file(c.err_path);
  const std::string out = read_file(c.out_path);
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
  Child c = start({"--trainers=2", "--ps=2", "--iters=500", "--warmup=0", "--pytorch=false",
                   "--json=" + absl::StrCat(std::getenv("TEST_TMPDIR"), "/killed.json")},
                  "killed");
  // Wait until training runs, then kill ps0 (rank 2 = trainers + 0).
  absl::Time deadline = absl::Now() + absl::Minutes(2);
  while (read_file(c.err_path).find("iteration 2/") == std::string::npos && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  pid_t ps0 = find_rank("killed", 2);
  ASSERT_GT(ps0, 0) << "ps0 not found; benchmark stderr:\n" << tail(read_file(c.err_path));
  absl::Time killed = absl::Now();
  kill(ps0, SIGKILL);
  int code = wait_for(c, absl::Seconds(90));
  EXPECT_NE(code, 0);
  EXPECT_NE(code, -1) << "the benchmark hung after a parameter server died";
  EXPECT_LT(absl::Now() - killed, absl::Seconds(60));
  const std::string err = read_file(c.err_path);
  // e.g. "rref.rpc('ddprpc.models.EmbeddingTable.forward') on worker 'ps0' failed"
  EXPECT_TRUE(std::regex_search(err, std::regex(R"(\('[A-Za-z_.]+'\) on worker 'ps0' failed)")))
      << tail(err);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_TRUE(run_processes("killed").empty()) << "orphaned benchmark processes";
}

}  // namespace
