#include "rpc/rendezvous/launch.h"

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace ddprpc::rpc {
namespace {

LaunchOptions sh(int nprocs, const std::string& script) {
  LaunchOptions o;
  o.nprocs = nprocs;
  o.argv = {"/bin/sh", "-c", script};
  o.timeout = absl::Seconds(20);
  return o;
}

// The store's port comes from below the ephemeral range, where no worker's
// listener (bind to port 0) or outgoing connection can take it between the
// pick and rank 0's bind; and a listener can bind it.
TEST(LaunchTest, PickedPortsAreOutsideTheEphemeralRangeAndBindable) {
  int low = 0, high = 0;
  FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(std::fscanf(f, "%d %d", &low, &high), 2);
  std::fclose(f);
  ASSERT_GT(low, 11000) << "this kernel's ephemeral range leaves no room below it";
  for (int i = 0; i < 20; ++i) {
    const int port = pick_free_port();
    ASSERT_GT(port, 0);
    EXPECT_LT(port, low);
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << port;
    EXPECT_EQ(::listen(fd, 1), 0) << port;
    ::close(fd);
  }
}

int open_fds() {
  int n = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  while (::readdir(dir) != nullptr) ++n;
  ::closedir(dir);
  return n - 3;  // ".", ".." and the directory's own descriptor
}

// A launch that runs out of descriptors part way fails at once, naming the
// rank, and leaves nothing behind: no rank running or unreaped, no pipe
// open. (In a child process of its own: the descriptor limit is the
// process's.)
TEST(LaunchTest, RunningOutOfDescriptorsPartWayLeavesNothingBehind) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int before = open_fds();
    const rlimit low{static_cast<rlim_t>(before + 12), static_cast<rlim_t>(before + 12)};
    if (before < 0 || ::setrlimit(RLIMIT_NOFILE, &low) != 0) ::_exit(10);
    const absl::Time start = absl::Now();
    LaunchResult r = launch(sh(20, "sleep 30"));
    if (r.exit_code != 1) ::_exit(11);
    if (r.message.find("no pipe for rank") == std::string::npos) ::_exit(12);
    if (absl::Now() - start > absl::Seconds(10)) ::_exit(13);
    if (open_fds() != before) ::_exit(14);
    errno = 0;
    if (::waitpid(-1, nullptr, WNOHANG) != -1 || errno != ECHILD) ::_exit(15);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  // 11-13: the launch did not fail as it should; 14: descriptors left
  // open; 15: a rank left running or unreaped.
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(LaunchTest, AllRanksSucceed) {
  auto r = launch(sh(3, "test \"$WORLD_SIZE\" = 3 && test -n \"$MASTER_PORT\" && test \"$RANK\" -lt 3"));
  EXPECT_EQ(r.exit_code, 0) << r.message;
}

TEST(LaunchTest, OneFailureStopsTheOthers) {
  absl::Time start = absl::Now();
  auto r = launch(sh(3, "if [ \"$RANK\" = 1 ]; then exit 7; fi; sleep 30"));
  EXPECT_EQ(r.exit_code, 7);
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(LaunchTest, TimeoutKillsEverything) {
  auto o = sh(2, "sleep 30");
  o.timeout = absl::Milliseconds(300);
  absl::Time start = absl::Now();
  auto r = launch(o);
  EXPECT_TRUE(r.timed_out);
  EXPECT_EQ(r.exit_code, 124);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// A rank that writes without pause (here lines of two bytes, each given a
// prefix) does not keep the launcher from its timeout.
TEST(LaunchTest, ARankThatNeverStopsWritingStillTimesOut) {
  auto o = sh(2, "yes & yes & yes & yes & wait");
  o.timeout = absl::Seconds(1);
  // The flood goes to /dev/null, not to the test's log.
  const int saved_out = ::dup(1), saved_err = ::dup(2);
  const int null = ::open("/dev/null", O_WRONLY);
  ASSERT_GE(null, 0);
  ::dup2(null, 1);
  ::dup2(null, 2);
  const absl::Time start = absl::Now();
  auto r = launch(o);
  const absl::Duration took = absl::Now() - start;
  ::dup2(saved_out, 1);
  ::dup2(saved_err, 2);
  for (int fd : {saved_out, saved_err, null}) ::close(fd);
  EXPECT_TRUE(r.timed_out);
  EXPECT_LT(took, absl::Seconds(10));
}

TEST(LaunchTest, MissingProgramFails) {
  LaunchOptions o;
  o.argv = {"/nonexistent/program"};
  EXPECT_EQ(launch(o).exit_code, 127);
}

// Forked without exec: each rank runs the entry in this image, with its
// environment, and its exit code and output come back as for exec.
TEST(LaunchTest, EntryRunsInForkedChildrenWithTheirEnvironment) {
  ASSERT_EQ(thread_count(), 1) << "the test process must have one thread here";
  static int parent_value = 0;
  parent_value = 42;  // set after start-up: only a forked child sees it
  LaunchOptions o;
  o.nprocs = 3;
  o.argv = {"/nonexistent/program", "--flag"};
  o.timeout = absl::Seconds(20);
  o.grace_period = absl::Seconds(10);  // ranks 0 and 1 finish after rank 2 failed
  o.env = {{"LAUNCH_TEST_VALUE", "x"}};
  o.entry = [](const std::vector<std::string>& argv) {
    const int rank = std::atoi(std::getenv("RANK"));
    if (parent_value != 42 || argv.size() != 2 || argv[1] != "--flag") return 3;
    if (std::string(std::getenv("WORLD_SIZE")) != "3" || !std::getenv("LAUNCH_TEST_VALUE")) return 4;
    std::printf("rank %d ran the entry\n", rank);
    return rank == 2 ? 9 : 0;
  };
  testing::internal::CaptureStdout();
  auto r = launch(o);
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_EQ(r.exit_code, 9) << r.message;
  EXPECT_EQ(r.failed_rank, 2);
  EXPECT_NE(out.find("[rank 0] rank 0 ran the entry"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 1] rank 1 ran the entry"), std::string::npos) << out;
}

// With a second thread running, the launcher executes argv[0] instead.
TEST(LaunchTest, EntryIsNotUsedWhenTheLauncherHasThreads) {
  bool stop = false;
  std::thread other([&stop] {
    while (!__atomic_load_n(&stop, __ATOMIC_ACQUIRE)) std::this_thread::yield();
  });
  LaunchOptions o = sh(2, "exit 5");
  o.entry = [](const std::vector<std::string>&) { return 0; };
  auto r = launch(o);
  __atomic_store_n(&stop, true, __ATOMIC_RELEASE);
  other.join();
  EXPECT_EQ(r.exit_code, 5) << "the entry ran instead of the program";
}

// With `output`, the ranks' lines of both streams, prefixed, and the
// launcher's own end up there.
TEST(LaunchTest, OutputIsCapturedWhenAsked) {
  std::string output;
  // Rank 1 fails only once rank 0 has written both lines (so that stopping
  // rank 0 cannot cut them off).
  const std::string done = absl::StrCat(
      std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp", "/launch_test.", ::getpid(),
      ".done");
  std::remove(done.c_str());
  LaunchOptions o = sh(2,
                       "if [ $RANK = 0 ]; then echo out0; echo err0 >&2; touch \"$DONE\"; exit 0; fi; "
                       "i=0; while [ ! -e \"$DONE\" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; "
                       "echo out1; echo err1 >&2; exit 1");
  o.env = {{"DONE", done}};
  o.output = &output;
  const LaunchResult r = launch(o);
  std::remove(done.c_str());
  EXPECT_EQ(r.exit_code, 1);
  for (const char* line : {"[rank 0] out0\n", "[rank 1] out1\n", "[rank 0] err0\n",
                           "[rank 1] err1\n", "launch: rank 1 exited with code 1"}) {
    EXPECT_NE(output.find(line), std::string::npos) << line << " not in:\n" << output;
  }
}

// A rank given a namespace that does not exist fails at once, saying so,
// and stops the others.
TEST(LaunchTest, AMissingNetworkNamespaceFailsTheRank) {
  LaunchOptions o = sh(2, "sleep 30");
  o.network_namespaces = {"ddprpc-no-such-namespace"};
  const absl::Time start = absl::Now();
  const LaunchResult r = launch(o);
  EXPECT_EQ(r.exit_code, 126) << r.message;
  EXPECT_FALSE(r.timed_out);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// Ranks run in the namespaces named, one after another by rank (root only:
// `ip netns add`).
TEST(LaunchTest, RanksJoinTheirNetworkNamespaces) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (ip netns)";
  const std::string a = absl::StrCat("ddprpc-lt", ::getpid(), "a");
  const std::string b = absl::StrCat("ddprpc-lt", ::getpid(), "b");
  if (std::system(("ip netns add " + a + " && ip netns add " + b).c_str()) != 0) {
    std::system(("ip netns del " + a + " 2>/dev/null; ip netns del " + b + " 2>/dev/null").c_str());
    GTEST_SKIP() << "ip netns add failed here";
  }
  // The namespace of this process, which the ranks must not be in.
  struct stat self {};
  ASSERT_EQ(::stat("/proc/self/ns/net", &self), 0);
  LaunchOptions o = sh(3, "");
  o.env = {{"NS_A", a}, {"NS_B", b}, {"LAUNCHER_NS", std::to_string(self.st_ino)}};
  o.argv = {"/bin/sh", "-c",
            "if [ $RANK = 1 ]; then ns=$NS_B; else ns=$NS_A; fi; "
            "mine=$(stat -L -c %i /proc/self/ns/net) && want=$(stat -L -c %i /var/run/netns/$ns) && "
            "test -n \"$mine\" && test \"$mine\" = \"$want\" && test \"$mine\" != \"$LAUNCHER_NS\""};
  o.network_namespaces = {a, b};
  const LaunchResult r = launch(o);
  std::system(("ip netns del " + a + "; ip netns del " + b).c_str());
  EXPECT_EQ(r.exit_code, 0) << r.message;
}

}  // namespace
}  // namespace ddprpc::rpc
