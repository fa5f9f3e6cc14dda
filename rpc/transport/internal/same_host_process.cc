#include "rpc/transport/internal/same_host_process.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "rpc/transport/internal/cross_memory.h"

namespace ddprpc::rpc::transport::same_host {

alignas(16) const char kProbe[16] = "ddprpc-cma-ok!!";

std::string read_small_file(const char* path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  std::string out = s.str();
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

std::string link_target(const char* path) {
  char buf[256];
  ssize_t n = readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string();
}

char process_state(pid_t pid) {
  const std::string path = absl::StrCat("/proc/", pid, "/stat");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno != ENOENT && errno != ESRCH) {
      // Without a descriptor the kernel still says whether it exists.
      return ::kill(pid, 0) != 0 && errno == ESRCH ? 0 : kStateUnknown;
    }
    return 0;
  }
  char buf[512];
  ssize_t n;
  do {
    n = ::read(fd, buf, sizeof(buf));
  } while (n < 0 && errno == EINTR);
  const int read_errno = errno;
  ::close(fd);
  if (n < 0) return read_errno == ESRCH ? 0 : kStateUnknown;
  const std::string_view stat(buf, static_cast<size_t>(n));
  const size_t close = stat.rfind(')');
  if (close == std::string_view::npos || close + 2 >= stat.size()) return kStateUnknown;
  return stat[close + 2];
}

bool can_read_remote(pid_t pid, uint64_t probe) {
  if (pid <= 0 || probe == 0) return false;
  char got[sizeof(kProbe)];
  return cross_memory::read_remote(pid, got, probe, sizeof(got)).ok() &&
         std::memcmp(got, kProbe, sizeof(got)) == 0;
}

void set_abstract_address(const std::string& name, sockaddr_un* addr, socklen_t* len) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(addr->sun_path) - 1);
  std::memcpy(addr->sun_path + 1, name.data(), n);  // sun_path[0] = 0: abstract
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

pid_t peer_pid_of(int fd, uid_t* uid) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return 0;
  *uid = cred.uid;
  return cred.pid;
}

}  // namespace ddprpc::rpc::transport::same_host
