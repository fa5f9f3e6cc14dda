#include "rpc/rendezvous/launch.h"

#include <algorithm>

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace ddprpc::rpc {
namespace {

struct Child {
  pid_t pid = -1;
  int out = -1;  // read ends of its stdout / stderr pipes
  int err = -1;
  std::string out_partial, err_partial;
  bool exited = false;
  int status = 0;
};

// In a forked child: joins the network namespace `name` (a name under
// /var/run/netns, or a path). Says why on stderr when it cannot.
bool join_network_namespace(const std::string& name) {
  const std::string path = name.find('/') == std::string::npos ? "/var/run/netns/" + name : name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) {
    std::fprintf(stderr, "launch: cannot join the network namespace %s: %s\n", path.c_str(),
                 std::strerror(errno));
    if (fd >= 0) ::close(fd);
    return false;
  }
  ::close(fd);
  return true;
}

void write_all(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += n;
  }
}

// Bytes drain() forwards per call, and the longest line kept whole.
constexpr size_t kDrainBytes = size_t{1} << 20;
constexpr size_t kMaxLineBytes = size_t{64} << 10;

// Emits the complete lines of `partial` (all of it at EOF) with a prefix. A
// line may also end in '\r' (a progress line redrawn in place): it goes out
// at once. On a terminal each line clears what a longer progress line left.
// A line longer than kMaxLineBytes goes out in pieces.
void emit(std::string& partial, const std::string& prefix, int to_fd, bool eof) {
  std::string out;
  size_t start = 0;
  const bool terminal = ::isatty(to_fd) == 1;
  while (true) {
    size_t end = partial.find_first_of("\n\r", start);
    if (end == std::string::npos) break;
    out += prefix;
    out.append(partial, start, end - start);
    if (terminal && partial[end] == '\n') out += "\033[K";
    out += partial[end];
    start = end + 1;
  }
  partial.erase(0, start);
  if ((eof && !partial.empty()) || partial.size() > kMaxLineBytes) {
    out += prefix + partial + "\n";
    partial.clear();
  }
  write_all(to_fd, out);
}

// Reads what is available on *fd, at most kDrainBytes: a rank that writes
// without pause must not keep the launcher from its deadlines and from the
// other ranks' output. Closes *fd at EOF.
void drain(int* fd, std::string& partial, const std::string& prefix, int to_fd) {
  char buf[65536];
  size_t taken = 0;
  while (*fd >= 0 && taken < kDrainBytes) {
    ssize_t n = ::read(*fd, buf, sizeof(buf));
    if (n > 0) {
      taken += static_cast<size_t>(n);
      partial.append(buf, n);
      emit(partial, prefix, to_fd, false);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    emit(partial, prefix, to_fd, true);
    ::close(*fd);
    *fd = -1;
  }
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

void kill_all(std::vector<Child>& children, int sig) {
  for (auto& c : children) {
    if (!c.exited && c.pid > 0) ::kill(-c.pid, sig);  // its whole process group
  }
}

// Ends a launch that could not start every rank: kills the ranks started,
// reaps them, and closes their pipes and the `extra` descriptors.
void abandon(std::vector<Child>& children, std::initializer_list<int> extra) {
  kill_all(children, SIGKILL);
  for (auto& c : children) {
    if (c.pid > 0 && !c.exited) {
      while (::waitpid(c.pid, &c.status, 0) < 0 && errno == EINTR) {
      }
      c.exited = true;
    }
    if (c.out >= 0) ::close(c.out);
    if (c.err >= 0) ::close(c.err);
    c.out = c.err = -1;
  }
  for (int fd : extra) {
    if (fd >= 0) ::close(fd);
  }
}

// Whether a listener could bind `port` on 127.0.0.1 now (port 0: any; then
// *port is the one the kernel chose).
bool bindable(int* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as gRPC's listeners do
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(*port));
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  if (ok) {
    socklen_t len = sizeof(addr);
    ok = ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
    *port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return ok;
}

// The first port of the kernel's ephemeral range (32768 if unreadable).
int ephemeral_low() {
  int low = 32768, high = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", &low, &high) != 2) low = 32768;
    std::fclose(f);
  }
  return low;
}

}  // namespace

int pick_free_port() {
  // Below the ephemeral range: the kernel hands those ports to every
  // bind(0) and outgoing connection, so one free a moment ago could be a
  // worker's listener or a connection's end by the time the store binds it.
  constexpr int kLowest = 10000;
  const int high = ephemeral_low();
  if (high - kLowest >= 1000) {
    std::mt19937 rng(std::random_device{}() ^ static_cast<unsigned>(::getpid()));
    std::uniform_int_distribution<int> pick(kLowest, high - 1);
    for (int attempt = 0; attempt < 64; ++attempt) {
      int port = pick(rng);
      if (bindable(&port)) return port;
    }
  }
  int port = 0;
  return bindable(&port) ? port : 0;
}

// 32 bytes from the kernel's generator, in hex.
static std::string random_token() {
  unsigned char bytes[32];
  size_t got = 0;
  if (FILE* f = std::fopen("/dev/urandom", "rb")) {
    got = std::fread(bytes, 1, sizeof(bytes), f);
    std::fclose(f);
  }
  if (got != sizeof(bytes)) {
    std::fprintf(stderr, "launch: no random bytes for the job token\n");
    std::abort();
  }
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

int thread_count() {
  DIR* dir = ::opendir("/proc/self/task");
  if (!dir) return 0;
  int n = 0;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n;
}

LaunchResult launch(const LaunchOptions& options) {
  LaunchResult result;
  if (options.argv.empty() || options.nprocs < 1) {
    result.exit_code = 2;
    result.message = "launch: nothing to run";
    return result;
  }
  const int port = options.master_port > 0 ? options.master_port : pick_free_port();
  // The children's job token (see launch.h).
  std::string token;
  const bool token_given = std::getenv("DDPRPC_AUTH_TOKEN") || std::getenv("DDPRPC_AUTH_TOKEN_FILE") ||
                           std::any_of(options.env.begin(), options.env.end(), [](const auto& kv) {
                             return kv.first == "DDPRPC_AUTH_TOKEN" ||
                                    kv.first == "DDPRPC_AUTH_TOKEN_FILE";
                           });
  if (!token_given) token = random_token();
  std::vector<Child> children(options.nprocs);
  const int threads = options.entry ? thread_count() : 0;
  const bool fork_only = options.entry && threads == 1 && options.network_namespaces.empty();
  if (options.entry && !fork_only && options.network_namespaces.empty()) {
    std::fprintf(stderr, "launch: %d threads run here, so the ranks start %s anew\n", threads,
                 options.argv[0].c_str());
  }
  ::fflush(stdout);
  ::fflush(stderr);
  for (int rank = 0; rank < options.nprocs; ++rank) {
    int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
    if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) {
      const int error = errno;
      abandon(children, {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]});
      result.exit_code = 1;
      result.message = absl::StrCat("launch: no pipe for rank ", rank, ": ", std::strerror(error));
      return result;
    }
    const pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      ::dup2(out_pipe[1], STDOUT_FILENO);
      ::dup2(err_pipe[1], STDERR_FILENO);
      if (!options.network_namespaces.empty()) {
        const std::string& ns =
            options.network_namespaces[rank % options.network_namespaces.size()];
        if (!join_network_namespace(ns)) ::_exit(126);
      }
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(options.nprocs).c_str(), 1);
      ::setenv("MASTER_ADDR", options.master_addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      if (!token.empty()) ::setenv("DDPRPC_AUTH_TOKEN", token.c_str(), 1);
      for (const auto& [k, v] : options.env) {
        if (v.empty()) {
          ::unsetenv(k.c_str());
        } else {
          ::setenv(k.c_str(), v.c_str(), 1);
        }
      }
      if (fork_only) {
        // What exec would have closed: the pipes of this and earlier ranks.
        for (const Child& c : children) {
          if (c.out >= 0) ::close(c.out);
          if (c.err >= 0) ::close(c.err);
        }
        ::close(out_pipe[0]);
        ::close(err_pipe[0]);
        ::close(out_pipe[1]);
        ::close(err_pipe[1]);
        int code = 1;
        try {
          code = options.entry(options.argv);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "launch: rank %d failed: %s\n", rank, e.what());
        } catch (...) {
          std::fprintf(stderr, "launch: rank %d failed with an unknown exception\n", rank);
        }
        ::fflush(stdout);
        ::fflush(stderr);
        ::_exit(code);
      }
      std::vector<char*> argv;
      for (const auto& a : options.argv) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      std::fprintf(stderr, "launch: cannot execute %s: %s\n", argv[0], std::strerror(errno));
      ::_exit(127);
    }
    if (pid < 0) {
      const int error = errno;
      abandon(children, {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]});
      result.exit_code = 1;
      result.message = absl::StrCat("launch: cannot fork rank ", rank, ": ", std::strerror(error));
      return result;
    }
    ::setpgid(pid, pid);  // also here, so kill(-pid) works right away
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    children[rank].pid = pid;
    children[rank].out = out_pipe[0];
    children[rank].err = err_pipe[0];
    ::fcntl(out_pipe[0], F_SETFL, O_NONBLOCK);
    ::fcntl(err_pipe[0], F_SETFL, O_NONBLOCK);
  }

  // Where the ranks' lines go.
  int out_fd = STDOUT_FILENO, err_fd = STDERR_FILENO;
  FILE* capture = options.output != nullptr ? std::tmpfile() : nullptr;
  if (capture != nullptr) out_fd = err_fd = ::fileno(capture);
  const absl::Time deadline = options.timeout == absl::InfiniteDuration()
                                  ? absl::InfiniteFuture()
                                  : absl::Now() + options.timeout;
  absl::Time term_at = absl::InfiniteFuture();  // SIGTERM the rest (after a failure)
  absl::Time kill_at = absl::InfiniteFuture();  // SIGKILL stragglers after SIGTERM
  int running = options.nprocs;
  while (true) {
    std::vector<pollfd> fds;
    for (auto& c : children) {
      if (c.out >= 0) fds.push_back({c.out, POLLIN, 0});
      if (c.err >= 0) fds.push_back({c.err, POLLIN, 0});
    }
    if (running == 0) {
      // Everyone exited: flush what is left, without waiting for
      // descendants that may still hold the pipes open.
      for (int rank = 0; rank < options.nprocs; ++rank) {
        Child& c = children[rank];
        const std::string prefix = options.prefix_output ? absl::StrCat("[rank ", rank, "] ") : "";
        drain(&c.out, c.out_partial, prefix, out_fd);
        drain(&c.err, c.err_partial, prefix, err_fd);
        emit(c.out_partial, prefix, out_fd, true);
        emit(c.err_partial, prefix, err_fd, true);
        if (c.out >= 0) ::close(c.out);
        if (c.err >= 0) ::close(c.err);
      }
      break;
    }
    if (!fds.empty()) {
      ::poll(fds.data(), fds.size(), 50);
    } else {
      ::usleep(20000);
    }
    for (int rank = 0; rank < options.nprocs; ++rank) {
      Child& c = children[rank];
      const std::string prefix = options.prefix_output ? absl::StrCat("[rank ", rank, "] ") : "";
      drain(&c.out, c.out_partial, prefix, out_fd);
      drain(&c.err, c.err_partial, prefix, err_fd);
      if (!c.exited && ::waitpid(c.pid, &c.status, WNOHANG) == c.pid) {
        c.exited = true;
        --running;
        int code = exit_code_of(c.status);
        if (code != 0 && result.exit_code == 0) {
          result.exit_code = code;
          result.failed_rank = rank;
          result.message = absl::StrCat("rank ", rank, " exited with code ", code,
                                        running > 0 ? "; stopping the others" : "");
          term_at = absl::Now() + options.grace_period;
        }
      }
    }
    const absl::Time now = absl::Now();
    if (now >= deadline && !result.timed_out && running > 0) {
      result.timed_out = true;
      result.exit_code = 124;
      result.message = absl::StrCat("timed out after ", absl::FormatDuration(options.timeout),
                                    "; stopping all ranks");
      kill_all(children, SIGTERM);
      kill_at = now + absl::Seconds(3);
    }
    if (now >= term_at) {
      kill_all(children, SIGTERM);
      term_at = absl::InfiniteFuture();
      kill_at = now + absl::Seconds(3);
    }
    if (now >= kill_at) kill_all(children, SIGKILL);
  }
  if (!result.message.empty()) {
    write_all(err_fd, "launch: " + result.message + "\n");
  }
  if (capture != nullptr) {
    std::rewind(capture);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), capture)) > 0) options.output->append(buf, n);
    std::fclose(capture);
  }
  return result;
}

}  // namespace ddprpc::rpc
