#include "benchmarks/testing/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace ddprpc::benchmarks::testing {

std::string binary(const std::string& path) {
  return absl::StrCat(std::getenv("TEST_SRCDIR"), "/ddprpc/", path);
}

std::string test_tmp(const std::string& name) {
  return absl::StrCat(std::getenv("TEST_TMPDIR"), "/", name);
}

std::vector<double> json_numbers(const JsonValue& v, std::initializer_list<std::string> keys) {
  std::vector<double> out;
  const JsonValue* list = json_at(v, keys);
  if (list == nullptr || !list->has_list_value()) return out;
  for (const JsonValue& x : list->list_value().values()) out.push_back(x.number_value());
  return out;
}

double numpy_percentile(std::vector<double> samples, double pct) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const double rank = pct / 100.0 * static_cast<double>(samples.size() - 1);
  const double below = std::floor(rank);
  const double above = std::ceil(rank);
  const double low = samples[static_cast<size_t>(below)];
  const double high = samples[static_cast<size_t>(above)];
  return low * (above - rank) + high * (rank - below) + (above == below ? low : 0);
}

std::string tail(const std::string& s) { return s.size() > 3000 ? s.substr(s.size() - 3000) : s; }

Child::Child(const std::string& path, const std::vector<std::string>& args, const std::string& tag)
    : out_path_(absl::StrCat(std::getenv("TEST_TMPDIR"), "/", tag, ".out")),
      err_path_(absl::StrCat(std::getenv("TEST_TMPDIR"), "/", tag, ".err")) {
  const std::string marker = absl::StrCat(getpid(), "-", tag);
  pid_ = fork();
  if (pid_ == 0) {
    setenv("DDPRPC_TEST_RUN", marker.c_str(), 1);  // the ranks inherit it
    int out = open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(out, 1);
    dup2(err, 2);
    std::vector<std::string> copy = args;
    std::string bin = path;
    std::vector<char*> argv{bin.data()};
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
}

Child::~Child() {
  if (pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

int Child::wait_for(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return -1;
}

namespace {
std::vector<std::string> environment(pid_t pid) {
  std::vector<std::string> vars;
  std::istringstream in(read_file(absl::StrCat("/proc/", pid, "/environ")));
  for (std::string var; std::getline(in, var, '\0');) vars.push_back(var);
  return vars;
}
}  // namespace

std::vector<pid_t> run_processes(const std::string& tag) {
  const std::string marker = absl::StrCat("DDPRPC_TEST_RUN=", getpid(), "-", tag);
  std::vector<pid_t> out;
  std::error_code ignored;  // processes come and go while we list them
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ignored)) {
    pid_t pid;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &pid)) continue;
    for (const auto& var : environment(pid)) {
      if (var == marker) out.push_back(pid);
    }
  }
  return out;
}

pid_t find_rank(const std::string& tag, int rank) {
  const std::vector<pid_t> procs = run_processes(tag);
  auto has_rank = [](pid_t pid, const std::string& value) {
    for (const auto& var : environment(pid)) {
      if (absl::StartsWith(var, "RANK=") && (value.empty() || var == "RANK=" + value)) return true;
    }
    return false;
  };
  // A rank that was executed shows its RANK in /proc/<pid>/environ.
  for (pid_t pid : procs) {
    if (has_rank(pid, std::to_string(rank))) return pid;
  }
  // Ranks forked without exec (rpc::LaunchOptions::entry) keep the
  // launcher's initial environment: they are its children, listed in the
  // order it forked them.
  for (pid_t pid : procs) {
    if (has_rank(pid, "")) continue;
    std::istringstream children(read_file(absl::StrCat("/proc/", pid, "/task/", pid, "/children")));
    std::vector<pid_t> ranks;
    for (pid_t child; children >> child;) {
      if (std::find(procs.begin(), procs.end(), child) != procs.end()) ranks.push_back(child);
    }
    if (rank < static_cast<int>(ranks.size())) return ranks[rank];
  }
  return -1;
}

}  // namespace ddprpc::benchmarks::testing
