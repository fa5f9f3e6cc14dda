// NetworkHosts (root only): the namespaces it makes are hosts of their own,
// each with its address, reaching each other over the bridge; they are gone
// once it is destroyed, and those of a run that was killed are removed by
// the next one made. The ranks are this binary again (main below), placed
// by rpc::launch.
#include "benchmarks/network_hosts.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "benchmarks/raw_tcp.h"
#include "gtest/gtest.h"
#include "rpc/rendezvous/launch.h"

namespace bench = ddprpc::benchmarks;

namespace {

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string();
}

// A rank: rank 0 listens on the address that routes to MASTER_ADDR (its
// own), names its port in $PORT_FILE and times round trips with 2 streams;
// rank 1 (on the other host) echoes them.
int rank_main() {
  const std::string master = std::getenv("MASTER_ADDR");
  const std::string port_file = std::getenv("PORT_FILE");
  const std::string here = bench::local_address_towards(master);
  if (std::atoi(std::getenv("RANK")) == 0) {
    if (here != master) {
      std::fprintf(stderr, "rank 0 is at %s, not at %s\n", here.c_str(), master.c_str());
      return 2;
    }
    bench::RawTcpListener listener;
    if (!bench::raw_tcp_listen(here, &listener).ok()) return 3;
    std::ofstream(port_file + ".tmp") << listener.port;
    std::rename((port_file + ".tmp").c_str(), port_file.c_str());
    std::vector<double> micros;
    const absl::Status s = bench::raw_tcp_round_trips(listener, 2, 1 << 20, 1, 3, &micros);
    if (!s.ok()) std::fprintf(stderr, "rank 0: %s\n", s.ToString().c_str());
    return s.ok() && micros.size() == 3 ? 0 : 4;
  }
  if (here == master || here.empty() || here == "127.0.0.1") {
    std::fprintf(stderr, "rank 1 is at '%s', not on a host of its own\n", here.c_str());
    return 5;
  }
  int port = 0;
  for (int i = 0; i < 200 && port == 0; ++i) {
    std::ifstream(port_file) >> port;
    if (port == 0) ::usleep(50000);
  }
  const absl::Status s = bench::raw_tcp_echo(master, port, 2, 1 << 20, 4);
  if (!s.ok()) std::fprintf(stderr, "rank 1: %s\n", s.ToString().c_str());
  return s.ok() ? 0 : 6;
}

TEST(NetworkHostsTest, HostsReachEachOtherAndAreRemoved) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (ip netns)";
  std::string error;
  std::unique_ptr<bench::NetworkHosts> hosts = bench::NetworkHosts::create(2, &error);
  ASSERT_NE(hosts, nullptr) << error;
  ASSERT_EQ(hosts->size(), 2);
  const std::vector<std::string> names = hosts->namespaces();
  EXPECT_NE(hosts->address(0), hosts->address(1));
  for (const std::string& ns : names) EXPECT_TRUE(exists("/var/run/netns/" + ns)) << ns;

  ddprpc::rpc::LaunchOptions o;
  o.nprocs = 2;
  o.argv = {self_exe()};
  o.network_namespaces = names;
  o.master_addr = hosts->address(0);
  o.timeout = absl::Seconds(60);
  const std::string port_file =
      absl::StrCat(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp",
                   "/network_hosts_test.", ::getpid(), ".port");
  std::remove(port_file.c_str());
  o.env = {{"NETWORK_HOSTS_TEST_RANK", "1"}, {"PORT_FILE", port_file}};
  const ddprpc::rpc::LaunchResult r = ddprpc::rpc::launch(o);
  std::remove(port_file.c_str());
  EXPECT_EQ(r.exit_code, 0) << r.message;

  hosts.reset();
  for (const std::string& ns : names) EXPECT_FALSE(exists("/var/run/netns/" + ns)) << ns;
}

TEST(NetworkHostsTest, WhatAKilledRunLeftIsRemovedByTheNext) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (ip netns)";
  const pid_t child = ::fork();
  if (child == 0) {
    std::string error;
    // Made and never destroyed, as by a run killed with SIGKILL.
    ::_exit(bench::NetworkHosts::create(1, &error).release() != nullptr ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const std::string left = absl::StrCat("/var/run/netns/ddprpc-bench-", child, "-h1");
  ASSERT_TRUE(exists(left));
  std::string error;
  std::unique_ptr<bench::NetworkHosts> next = bench::NetworkHosts::create(1, &error);
  ASSERT_NE(next, nullptr) << error;
  EXPECT_FALSE(exists(left));
}

TEST(NetworkHostsTest, ACountOutOfRangeIsRefused) {
  std::string error;
  EXPECT_EQ(bench::NetworkHosts::create(0, &error), nullptr);
  EXPECT_NE(error.find("between 1 and 9"), std::string::npos) << error;
  EXPECT_EQ(bench::NetworkHosts::create(10, &error), nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  if (std::getenv("NETWORK_HOSTS_TEST_RANK") != nullptr) return rank_main();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
