#include "benchmarks/network_hosts.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "benchmarks/common.h"

namespace ddprpc::benchmarks {
namespace {

// Namespaces are named kPrefix<pid>-h<i>; the bridge kBridge<pid>, the
// root-side ends of the veth pairs kVeth<pid>x<i> (links: 15 characters at
// most).
constexpr char kPrefix[] = "ddprpc-bench-";
constexpr char kBridge[] = "dbr";
constexpr char kVeth[] = "dve";
constexpr char kSubnet[] = "10.213.0.";

bool ip(const std::vector<std::string>& args, std::string* error = nullptr) {
  std::vector<std::string> argv = {"ip"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::string output;
  const int code = run_command(argv, &output);
  if (code != 0 && error != nullptr) {
    *error = absl::StrCat("`ip ", absl::StrJoin(args, " "), "` failed (exit ", code, "): ", output);
  }
  return code == 0;
}

// Removes what runs whose process is gone left behind.
void remove_stale() {
  DIR* dir = ::opendir("/var/run/netns");
  if (dir == nullptr) return;
  std::vector<std::string> stale;
  while (dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.rfind(kPrefix, 0) != 0) continue;
    const std::vector<std::string> parts = absl::StrSplit(name.substr(sizeof(kPrefix) - 1), '-');
    int pid = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &pid) || pid <= 0) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;
    stale.push_back(name);
    stale.push_back(absl::StrCat(kBridge, pid));
  }
  ::closedir(dir);
  for (size_t i = 0; i < stale.size(); i += 2) {
    ip({"netns", "del", stale[i]});
    ip({"link", "del", stale[i + 1]});  // once per bridge; later tries fail quietly
  }
}

}  // namespace

std::unique_ptr<NetworkHosts> NetworkHosts::create(int count, std::string* error) {
  if (count < 1 || count > 9) {
    *error = absl::StrCat("between 1 and 9 hosts, not ", count);
    return nullptr;
  }
  if (::geteuid() != 0) {
    *error = "network namespaces need root (ip netns)";
    return nullptr;
  }
  remove_stale();
  const int pid = ::getpid();
  std::vector<std::string> names;
  for (int i = 1; i <= count; ++i) names.push_back(absl::StrCat(kPrefix, pid, "-h", i));
  std::unique_ptr<NetworkHosts> hosts(new NetworkHosts(absl::StrCat(kBridge, pid), names));
  bool ok = ip({"link", "add", hosts->bridge_, "type", "bridge"}, error) &&
            ip({"link", "set", hosts->bridge_, "up"}, error);
  for (int i = 0; ok && i < count; ++i) {
    const std::string& ns = names[i];
    const std::string veth = absl::StrCat(kVeth, pid, "x", i + 1);
    ok = ip({"netns", "add", ns}, error) &&
         ip({"link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns}, error) &&
         ip({"link", "set", veth, "master", hosts->bridge_}, error) &&
         ip({"link", "set", veth, "up"}, error) &&
         ip({"-n", ns, "addr", "add", absl::StrCat(hosts->address(i), "/24"), "dev", "eth0"},
            error) &&
         ip({"-n", ns, "link", "set", "eth0", "up"}, error) &&
         ip({"-n", ns, "link", "set", "lo", "up"}, error);
  }
  if (!ok) return nullptr;  // the destructor removes what was made
  return hosts;
}

NetworkHosts::~NetworkHosts() { remove(); }

void NetworkHosts::remove() {
  for (const std::string& ns : namespaces_) ip({"netns", "del", ns});
  ip({"link", "del", bridge_});
}

std::string NetworkHosts::address(int i) const { return absl::StrCat(kSubnet, i + 1); }

std::string NetworkHosts::describe() const {
  return absl::StrCat(size(), " network namespaces on a bridge (veth, MTU 1500): ", kSubnet,
                      size() > 1 ? absl::StrCat("1-", size()) : "1", ", rank r on host r % ",
                      size());
}

void NetworkHosts::place(RolesOptions* options) const {
  options->network_namespaces = namespaces_;
  options->master_addr = address(0);
}

std::unique_ptr<NetworkHosts> hosts_from_flag(const char* benchmark, int count) {
  if (count == 0) return nullptr;
  std::string error;
  std::unique_ptr<NetworkHosts> hosts = NetworkHosts::create(count, &error);
  if (!hosts) {
    std::fprintf(stderr, "%s: --hosts=%d: %s\n", benchmark, count, error.c_str());
    std::exit(1);
  }
  return hosts;
}

std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || !found) return "";
  std::string address;
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in self{};
  socklen_t len = sizeof(self);
  char text[INET_ADDRSTRLEN];
  // Connecting a UDP socket sends nothing; it only picks the route.
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &len) == 0 &&
      ::inet_ntop(AF_INET, &self.sin_addr, text, sizeof(text))) {
    address = text;
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(found);
  return address;
}

}  // namespace ddprpc::benchmarks
