#include "rpc/transport/same_host_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "rpc/core/internal/auth.h"
#include "rpc/core/internal/fault.h"
#include "rpc/core/internal/thread_policy.h"
#include "rpc/core/security.h"
#include "rpc/transport/internal/cross_memory.h"
#include "rpc/transport/internal/frame_capture.h"
#include "rpc/transport/internal/same_host_protocol.h"
#include "rpc/transport/internal/spin_poll.h"
#include "rpc/transport/spin_budget.h"

namespace ddprpc::rpc::transport {
namespace {

using internal::Frame;

// The protocol (internal/same_host_protocol.h).
using same_host::HelloBody;
using same_host::Kind;
using same_host::Preamble;
using same_host::RemoteTensor;
using same_host::WelcomeBody;
using same_host::kAck;
using same_host::kConfirm;
using same_host::kFlagCrossMemory;
using same_host::kFlagMoreInFlight;
using same_host::kFrame;
using same_host::kGoodbye;
using same_host::kHello;
using same_host::kMagic;
using same_host::kWelcome;

// What a transport's servers and channels share: its options, and the spin
// its waits may take (set once the world is known).
struct Settings {
  explicit Settings(TransportOptions o) : options(std::move(o)) {}
  const TransportOptions options;
  std::atomic<int64_t> spin_ns{0};
};

// A frame read, written to the capture directory if there is one.
void capture(const Settings& settings, const char* kind, const Frame& frame) {
  if (settings.options.capture_frames_dir.empty()) return;
  internal::capture_frame(settings.options.capture_frames_dir, kind,
                          rpc::internal::serialize_frame(frame));
}

constexpr uint32_t kMaxHandshakeBody = 4096;
constexpr absl::Duration kHandshakeTimeout = absl::Seconds(10);
// What each process shows its peers to test cross-memory reads.
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

// The state letter of process `pid` ('R', 'S', 'T', 'Z', ...), 0 if it is
// gone, or kStateUnknown when /proc cannot say (no descriptor left, no
// memory): the process then counts as running, since a failing read says
// nothing of the peer.
constexpr char kStateUnknown = '?';
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

// ------------------------------------------------------------ connection

// One end of a socket: sends from any thread without blocking (what the
// socket does not take waits in a queue that the reading thread flushes),
// and reads on one thread at a time.
class Conn {
 public:
  // `on_wake`, if given, runs at every wake() besides the eventfd: for a
  // connection whose reader waits elsewhere (the server's epoll set).
  // Tensors are lent by address while the peer has not acknowledged more
  // than `max_lent_bytes` (one tensor is lent whatever its size when none
  // is); beyond, they go inline.
  Conn(int fd, pid_t peer_pid, int64_t max_message_bytes, absl::Duration keepalive_interval,
       absl::Duration keepalive_timeout, std::function<void()> on_wake = nullptr,
       int64_t max_lent_bytes = INT64_MAX)
      : fd_(fd),
        wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
        peer_pid_(peer_pid),
        max_message_bytes_(max_message_bytes),
        max_lent_bytes_(max_lent_bytes),
        keepalive_interval_(std::max(keepalive_interval, absl::Milliseconds(10))),
        keepalive_timeout_(keepalive_timeout),
        on_wake_(std::move(on_wake)) {}
  ~Conn() {
    ::close(fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;

  pid_t peer_pid() const { return peer_pid_; }

  void set_may_send_remote(bool may) {
    absl::MutexLock lock(&write_mu_);
    may_send_remote_ = may;
  }

  // Queues a frame; false once the connection is shut down or broken.
  bool send_frame(const Frame& frame) {
    std::string head = internal::serialize_head(frame);
    Preamble p;
    p.kind = kFrame;
    p.flags = frame.more_in_flight ? kFlagMoreInFlight : 0;
    p.body = static_cast<uint32_t>(head.size());
    std::vector<RemoteTensor> remote;
    std::vector<at::Tensor> held;
    std::vector<const at::Tensor*> inline_tensors;
    absl::MutexLock lock(&write_mu_);
    if (shut_ || broken_) return false;
    for (size_t i = 0; i < frame.tensors.size(); ++i) {
      const at::Tensor& t = frame.tensors[i];
      if (!t.defined() || t.numel() == 0) continue;
      const uint64_t n = t.numel() * t.element_size();
      const int64_t lent = unacked_bytes_ + static_cast<int64_t>(p.remote_bytes);
      if (may_send_remote_ && n >= kCrossMemoryMinBytes &&
          (lent == 0 || lent + static_cast<int64_t>(n) <= max_lent_bytes_)) {
        remote.push_back({static_cast<uint32_t>(i), 0, reinterpret_cast<uint64_t>(t.data_ptr())});
        held.push_back(t);
        p.remote_bytes += n;
      } else {
        inline_tensors.push_back(&t);
        p.inline_bytes += n;
      }
    }
    p.num_remote = static_cast<uint32_t>(remote.size());
    if (!remote.empty()) {
      p.seq = ++next_seq_;
      unacked_.emplace(p.seq, std::make_pair(std::move(held), p.remote_bytes));
      unacked_bytes_ += p.remote_bytes;
    }
    std::string first(sizeof(p) + head.size() + remote.size() * sizeof(RemoteTensor), '\0');
    std::memcpy(first.data(), &p, sizeof(p));
    std::memcpy(first.data() + sizeof(p), head.data(), head.size());
    if (!remote.empty()) {
      std::memcpy(first.data() + sizeof(p) + head.size(), remote.data(),
                  remote.size() * sizeof(RemoteTensor));
    }
    enqueue(std::move(first), at::Tensor());
    for (const at::Tensor* t : inline_tensors) enqueue(std::string(), *t);
    flush_locked();
    return !broken_;
  }

  // Sends a message without tensors.
  bool send_control(Kind kind, uint8_t flags, uint64_t seq, const std::string& body = {}) {
    Preamble p;
    p.kind = kind;
    p.flags = flags;
    p.seq = seq;
    p.body = static_cast<uint32_t>(body.size());
    std::string bytes(sizeof(p) + body.size(), '\0');
    std::memcpy(bytes.data(), &p, sizeof(p));
    std::memcpy(bytes.data() + sizeof(p), body.data(), body.size());
    absl::MutexLock lock(&write_mu_);
    if (shut_ || broken_) return false;
    enqueue(std::move(bytes), at::Tensor());
    flush_locked();
    return !broken_;
  }

  // Whether writing found the peer's end closed.
  bool peer_closed() const {
    absl::MutexLock lock(&write_mu_);
    return peer_closed_;
  }

  // Bytes queued here, not yet taken by the socket.
  int64_t queued_bytes() const {
    absl::MutexLock lock(&write_mu_);
    return queued_bytes_;
  }

  absl::Status on_ack(uint64_t seq) {
    absl::MutexLock lock(&write_mu_);
    auto it = unacked_.find(seq);
    if (it == unacked_.end()) {
      return absl::DataLossError(absl::StrCat("acknowledgement of unknown frame ", seq));
    }
    unacked_bytes_ -= it->second.second;
    unacked_.erase(it);
    return absl::OkStatus();
  }

  // No more sends; wakes the reader, whose next wait fails.
  void shutdown() {
    {
      absl::MutexLock lock(&write_mu_);
      shut_ = true;
      out_.clear();
      queued_bytes_ = 0;
    }
    ::shutdown(fd_, SHUT_RDWR);
    wake();
  }

  // Lets the writes queued so far go out (at most `timeout`), then shuts down.
  void shutdown_after_flush(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      {
        absl::MutexLock lock(&write_mu_);
        flush_locked();
        if (out_.empty() || broken_) break;
      }
      if (absl::Now() >= deadline) break;
      pollfd p{fd_, POLLOUT, 0};
      poll(&p, 1, 5);
    }
    shutdown();
  }

  bool broken() const {
    absl::MutexLock lock(&write_mu_);
    return broken_ || shut_;
  }

  void wake() {
    if (on_wake_) on_wake_();
    if (wake_fd_ < 0) return;
    uint64_t one = 1;
    ssize_t ignored = ::write(wake_fd_, &one, sizeof(one));
    (void)ignored;
  }

  // ---- reading: one thread at a time.

  // Waits until the socket has bytes (flushing the send queue and watching
  // the peer meanwhile), or `deadline`. Cancelled once shut down;
  // Unavailable when the peer's process stopped or died. With `yield`,
  // returns Aborted whenever yield() is true when it looks.
  absl::Status wait_readable(absl::Time deadline = absl::InfiniteFuture(),
                             const std::function<bool()>& yield = nullptr) {
    for (;;) {
      if (shut_now()) return absl::CancelledError("the connection was closed");
      if (yield && yield()) return absl::AbortedError("another thread reads");
      bool want_out;
      {
        absl::MutexLock lock(&write_mu_);
        flush_locked();
        want_out = !out_.empty();
        if (broken_) return absl::UnavailableError(broken_why_);
      }
      if (has_buffered()) return absl::OkStatus();
      pollfd fds[2] = {{fd_, static_cast<short>(POLLIN | (want_out ? POLLOUT : 0)), 0},
                       {wake_fd_, POLLIN, 0}};
      const absl::Time now = absl::Now();
      absl::Duration wait = std::min(keepalive_interval_, deadline - now);
      if (wait <= absl::ZeroDuration()) return absl::DeadlineExceededError("timed out");
      const int timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(wait) + 1);
      int r = poll(fds, 2, timeout_ms);
      if (r < 0 && errno != EINTR) return absl::InternalError(std::strerror(errno));
      if (fds[1].revents & POLLIN) drain_wake();
      if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
        stopped_since_ = absl::InfiniteFuture();
        return absl::OkStatus();
      }
      if (r == 0) {
        absl::Status alive = check_peer();
        if (!alive.ok()) return alive;
      }
    }
  }

  int fd() const { return fd_; }
  int wake_fd() const { return wake_fd_; }
  void drain_wake() {
    uint64_t v;
    ssize_t ignored = ::read(wake_fd_, &v, sizeof(v));
    (void)ignored;
  }
  // Writes what the socket takes; true if something is left to write.
  bool flush() {
    absl::MutexLock lock(&write_mu_);
    flush_locked();
    return !out_.empty();
  }
  // The same, for a reader that polls the socket elsewhere: `want_out` says
  // whether something is left; Cancelled once shut down, Unavailable once
  // broken.
  absl::Status flush_for_reader(bool* want_out) {
    absl::MutexLock lock(&write_mu_);
    flush_locked();
    *want_out = !out_.empty();
    if (shut_) return absl::CancelledError("the connection was closed");
    if (broken_) return absl::UnavailableError(broken_why_);
    return absl::OkStatus();
  }
  // Reads what the socket holds into the read-ahead buffer (one recv that
  // does not wait) when that buffer is empty: OK with bytes buffered, or
  // with `would_block` set when the socket had none; Unavailable at the end
  // of the stream (`eof` set). After start_reading_ahead() only.
  absl::Status fill(bool* would_block, bool* eof) {
    *would_block = false;
    *eof = false;
    while (!has_buffered()) {
      ssize_t got = recv(fd_, ahead_.get(), kReadAhead, MSG_DONTWAIT);
      if (got > 0) {
        ahead_pos_ = 0;
        ahead_end_ = static_cast<size_t>(got);
        read_all_ = ahead_end_ < kReadAhead;
        stopped_since_ = absl::InfiniteFuture();
        break;
      }
      if (got == 0 || errno == ECONNRESET) {
        *eof = true;
        return absl::UnavailableError("the peer closed the connection");
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        *would_block = true;
        break;
      }
      return absl::UnavailableError(absl::StrCat("reading the connection failed: ",
                                                 std::strerror(errno)));
    }
    return absl::OkStatus();
  }
  // Whether the peer's process still runs (see check_peer), for a reader
  // that waits elsewhere and has not heard from it for keepalive_interval.
  absl::Status check_peer_alive() { return check_peer(); }
  // The peer check of wait_readable, at most once per keepalive_interval,
  // for threads that poll the socket themselves.
  absl::Status check_peer_now_and_then() {
    const absl::Time now = absl::Now();
    if (now - last_check_ < keepalive_interval_ / 2) return absl::OkStatus();
    last_check_ = now;
    return check_peer();
  }

  // From here on, reads take what the socket holds (up to kReadAhead
  // bytes) and keep what is not asked for yet: a small message costs one
  // recv, and messages that came together one recv for all. Called once
  // the handshake is done: nothing a peer sends before is read ahead.
  void start_reading_ahead() {
    if (!ahead_) ahead_.reset(new char[kReadAhead]);  // not zeroed: only what recv wrote is read
  }
  // Whether bytes read ahead wait: the socket's readiness does not show them.
  bool has_buffered() const { return ahead_pos_ < ahead_end_; }
  // Whether every byte read so far has been used and the last read took
  // all the socket held: bytes that come later show as readiness, so a
  // reader polling the socket need not try to read first.
  bool drained() const { return !has_buffered() && read_all_; }

  // Reads exactly n bytes; Unavailable at end of stream (eof set when no
  // byte of them came).
  absl::Status read_exact(void* dst, size_t n, bool* eof = nullptr,
                          absl::Time deadline = absl::InfiniteFuture()) {
    auto* out = static_cast<char*>(dst);
    size_t done = 0;
    if (eof) *eof = false;
    while (done < n) {
      if (ahead_pos_ < ahead_end_) {
        const size_t take = std::min(ahead_end_ - ahead_pos_, n - done);
        std::memcpy(out + done, ahead_.get() + ahead_pos_, take);
        ahead_pos_ += take;
        done += take;
        continue;
      }
      // Large reads go straight to their destination.
      const bool ahead = ahead_ && n - done < kReadAhead;
      ssize_t got = ahead ? recv(fd_, ahead_.get(), kReadAhead, MSG_DONTWAIT)
                          : recv(fd_, out + done, n - done, MSG_DONTWAIT);
      if (got > 0) {
        if (ahead) {
          ahead_pos_ = 0;
          ahead_end_ = static_cast<size_t>(got);
          read_all_ = ahead_end_ < kReadAhead;
        } else {
          done += got;
        }
        continue;
      }
      // A reset is a close with bytes left unread (the peer exited).
      if (got == 0 || errno == ECONNRESET) {
        if (eof && done == 0) *eof = true;
        return absl::UnavailableError("the peer closed the connection");
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        return absl::UnavailableError(absl::StrCat("reading the connection failed: ",
                                                   std::strerror(errno)));
      }
      absl::Status ready = wait_readable(deadline);
      if (!ready.ok()) return ready;
    }
    return absl::OkStatus();
  }

  // Reads n bytes into a string that grows with the bytes that came, so a
  // claim of many bytes costs resident memory only as they arrive. Its
  // capacity is reserved at once: one block, whose pages are touched only as
  // bytes are written. Grown by doubling instead, a large head left a trail
  // of freed 1..32 MiB blocks that glibc's allocator, its mmap threshold
  // raised by the first large free, kept in its heap (3 x 64 MiB resident
  // after a 64 MiB string argument).
  absl::Status read_growing(size_t n, std::string* out) {
    out->clear();
    out->reserve(n);
    constexpr size_t kStep = size_t{1} << 20;
    while (out->size() < n) {
      const size_t at = out->size();
      const size_t take = std::min(kStep, n - at);
      out->resize(at + take);
      absl::Status ok = read_exact(out->data() + at, take);
      if (!ok.ok()) return ok;
    }
    return absl::OkStatus();
  }

  // Reads a kFrame's head, descriptors and tensors, checking every claim.
  absl::Status read_frame(const Preamble& p, Frame* frame) {
    uint64_t total = p.body;
    if (__builtin_add_overflow(total, p.inline_bytes, &total) ||
        __builtin_add_overflow(total, p.remote_bytes, &total)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "a frame claims more than 2^64 bytes (its head, inline and remote bytes overflow); "
          "max_message_bytes is ", max_message_bytes_));
    }
    if (total > static_cast<uint64_t>(max_message_bytes_)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "a frame of ", total, " bytes exceeds max_message_bytes (", max_message_bytes_, ")"));
    }
    if (p.num_remote > static_cast<uint32_t>(internal::kMaxTensorsPerFrame) ||
        (p.num_remote == 0) != (p.remote_bytes == 0)) {
      return absl::DataLossError("a frame's remote tensors do not add up");
    }
    if (p.num_remote > 0 && peer_pid_ <= 0) {
      return absl::DataLossError("remote tensors from a peer whose process is unknown");
    }
    std::string head;
    absl::Status ok = read_growing(p.body, &head);
    if (!ok.ok()) return ok;
    std::vector<RemoteTensor> remote(p.num_remote);
    if (p.num_remote > 0) {
      ok = read_exact(remote.data(), remote.size() * sizeof(RemoteTensor));
      if (!ok.ok()) return ok;
      for (size_t i = 1; i < remote.size(); ++i) {
        if (remote[i].index <= remote[i - 1].index) {
          return absl::DataLossError("remote tensors out of order");
        }
      }
    }
    size_t next_remote = 0;
    uint64_t inline_read = 0;
    uint64_t remote_read = 0;
    ok = internal::parse_frame(
        head, p.inline_bytes + p.remote_bytes,
        [&](int index, void* dst, uint64_t n) -> absl::Status {
          if (next_remote < remote.size() && remote[next_remote].index == static_cast<uint32_t>(index)) {
            remote_read += n;
            if (remote_read > p.remote_bytes) {
              return absl::DataLossError("remote tensors exceed their claimed bytes");
            }
            return cross_memory::read_remote(peer_pid_, dst, remote[next_remote++].address, n);
          }
          inline_read += n;
          if (inline_read > p.inline_bytes) {
            return absl::DataLossError("inline tensors exceed their claimed bytes");
          }
          return read_exact(dst, n);
        },
        frame);
    if (!ok.ok()) return ok;
    if (next_remote != remote.size() || remote_read != p.remote_bytes ||
        inline_read != p.inline_bytes) {
      return absl::DataLossError("a frame's tensors do not match its remote and inline bytes");
    }
    return absl::OkStatus();
  }

 private:
  struct Piece {
    std::string bytes;
    at::Tensor tensor;  // or the tensor's bytes
    size_t done = 0;
    const char* base() const {
      return tensor.defined() ? static_cast<const char*>(tensor.data_ptr()) : bytes.data();
    }
    size_t size() const {
      return tensor.defined() ? tensor.numel() * tensor.element_size() : bytes.size();
    }
  };

  void enqueue(std::string bytes, at::Tensor tensor) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) {
    Piece piece;
    piece.bytes = std::move(bytes);
    piece.tensor = std::move(tensor);
    queued_bytes_ += piece.size();
    out_.push_back(std::move(piece));
  }

  // Writes what the socket takes now; wakes the reader to wait for room
  // when something is left.
  void flush_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) {
    while (!out_.empty() && !broken_) {
      iovec iov[64];
      int n = 0;
      for (auto it = out_.begin(); it != out_.end() && n < 64; ++it, ++n) {
        iov[n].iov_base = const_cast<char*>(it->base() + it->done);
        iov[n].iov_len = it->size() - it->done;
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = n;
      ssize_t sent = sendmsg(fd_, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (sent < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          if (!waiting_for_room_) {
            waiting_for_room_ = true;
            wake();  // the reader now polls for room
          }
          return;
        }
        broken_ = true;
        // A peer that closed its end (it exited, or closed the channel
        // while a reply was on its way) is an ordinary end, as a read
        // that finds it closed.
        peer_closed_ = errno == EPIPE || errno == ECONNRESET;
        broken_why_ = peer_closed_ ? std::string("the peer closed the connection")
                                   : absl::StrCat("writing the connection failed: ",
                                                  std::strerror(errno));
        out_.clear();
        queued_bytes_ = 0;
        wake();
        return;
      }
      queued_bytes_ -= sent;
      size_t left = sent;
      while (left > 0) {
        Piece& front = out_.front();
        const size_t take = std::min(left, front.size() - front.done);
        front.done += take;
        left -= take;
        if (front.done == front.size()) out_.pop_front();
      }
    }
    waiting_for_room_ = false;
  }

  bool shut_now() const {
    absl::MutexLock lock(&write_mu_);
    return shut_;
  }

  // Whether the peer's process still runs: gone or a zombie, or stopped
  // for keepalive_timeout, is unreachable.
  absl::Status check_peer() {
    if (peer_pid_ <= 0) return absl::OkStatus();
    const char state = process_state(peer_pid_);
    if (state == 0 || state == 'Z' || state == 'X') {
      return absl::UnavailableError(absl::StrCat("the peer process ", peer_pid_, " is gone"));
    }
    if (state == 'T' || state == 't') {
      const absl::Time now = absl::Now();
      if (stopped_since_ == absl::InfiniteFuture()) stopped_since_ = now;
      if (now - stopped_since_ >= keepalive_timeout_) {
        return absl::UnavailableError(absl::StrCat("the peer process ", peer_pid_,
                                                   " has been stopped for ",
                                                   absl::FormatDuration(now - stopped_since_)));
      }
    } else {
      stopped_since_ = absl::InfiniteFuture();
    }
    return absl::OkStatus();
  }

  const int fd_;
  const int wake_fd_;
  const pid_t peer_pid_;  // from the kernel (SO_PEERCRED), 0 if unknown
  const int64_t max_message_bytes_;
  const int64_t max_lent_bytes_;
  const absl::Duration keepalive_interval_;
  const absl::Duration keepalive_timeout_;
  const std::function<void()> on_wake_;
  static constexpr size_t kReadAhead = 64 << 10;
  // The reading thread's:
  absl::Time stopped_since_ = absl::InfiniteFuture();
  absl::Time last_check_ = absl::InfinitePast();
  std::unique_ptr<char[]> ahead_;  // bytes read ahead: [ahead_pos_, ahead_end_)
  size_t ahead_pos_ = 0;
  size_t ahead_end_ = 0;
  bool read_all_ = false;  // the last read into ahead_ left the socket empty

  mutable absl::Mutex write_mu_;
  // State below is protected by write_mu_.
  std::deque<Piece> out_ ABSL_GUARDED_BY(write_mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(write_mu_) = 0;
  bool waiting_for_room_ ABSL_GUARDED_BY(write_mu_) = false;
  bool may_send_remote_ ABSL_GUARDED_BY(write_mu_) = false;
  uint64_t next_seq_ ABSL_GUARDED_BY(write_mu_) = 0;
  std::map<uint64_t, std::pair<std::vector<at::Tensor>, uint64_t>> unacked_
      ABSL_GUARDED_BY(write_mu_);
  int64_t unacked_bytes_ ABSL_GUARDED_BY(write_mu_) = 0;
  bool shut_ ABSL_GUARDED_BY(write_mu_) = false;
  bool broken_ ABSL_GUARDED_BY(write_mu_) = false;
  std::string broken_why_ ABSL_GUARDED_BY(write_mu_);
  bool peer_closed_ ABSL_GUARDED_BY(write_mu_) = false;  // broken by the peer's close
};

absl::Status read_preamble(Conn* conn, Preamble* p, bool* eof,
                           absl::Time deadline = absl::InfiniteFuture()) {
  absl::Status ok = conn->read_exact(p, sizeof(*p), eof, deadline);
  if (!ok.ok()) return ok;
  if (p->magic != kMagic) return absl::DataLossError("a message without the protocol's magic");
  return absl::OkStatus();
}

// ------------------------------------------------------------ server
//
// One thread at a time holds a server's reading role: it waits on the
// epoll set of every connection (each armed for one event at a time) and
// serves the connections that have bytes, one message after another, each
// request run on that thread unless its caller said others are in flight.
// So requests that arrive while the role holder is busy cost no thread
// wake-up: it finds them when it looks again. A watchdog gives the role to
// another thread when a message has kept the holder for inline_handoff
// (a request that blocks, a peer that stopped halfway through a frame),
// and with it the connection of a request that blocks, so that the
// caller's next request is read.

class SameHostServer;

// Who reads a connection (ServerConn::reader), besides the id of a thread.
constexpr int64_t kNobody = 0;     // armed in the epoll set, queued, or parked while paused
constexpr int64_t kHandshake = -1;  // not yet in the server's table

// A caller's connection as the server sees it.
struct ServerConn {
  ServerConn(uint64_t key, uid_t uid) : key(key), peer_uid(uid) {}
  const uint64_t key;  // in the server's table and as its epoll data
  std::unique_ptr<Conn> conn;  // set once, before the connection is shared
  const uid_t peer_uid;
  int caller = -1;  // set by the handshake, before any request
  std::string address;
  // It wants the role holder's attention: replies went out while it was
  // paused, or its socket has room for what waits to be written.
  std::atomic<bool> poked{false};
  // In the server's ready_ queue; protected by the server's mu_.
  bool queued = false;

  absl::Mutex mu;
  // State below is protected by mu.
  int unanswered ABSL_GUARDED_BY(mu) = 0;
  bool paused ABSL_GUARDED_BY(mu) = false;  // not read until replies go out
  int64_t reader ABSL_GUARDED_BY(mu) = kHandshake;
};

class SameHostResponder : public Responder {
 public:
  SameHostResponder(std::shared_ptr<ServerConn> conn) : conn_(std::move(conn)) {}
  ~SameHostResponder() override {
    if (!answered_.exchange(true)) done();
  }
  void send(Frame reply) override {
    if (answered_.exchange(true)) return;
    reply.more_in_flight = false;
    conn_->conn->send_frame(reply);
    done();
  }
  bool answered() const override { return answered_.load(); }
  int caller() const override { return conn_->caller; }
  const std::string& address() const override { return conn_->address; }

 private:
  void done() {
    bool wake;
    {
      absl::MutexLock lock(&conn_->mu);
      --conn_->unanswered;
      wake = conn_->paused;
    }
    if (wake) conn_->conn->wake();
  }
  const std::shared_ptr<ServerConn> conn_;
  std::atomic<bool> answered_{false};
};

class SameHostServer : public std::enable_shared_from_this<SameHostServer> {
 public:
  using OnRequest = Transport::OnRequest;
  using CheckRequest = Transport::CheckRequest;

  static std::shared_ptr<SameHostServer> start(const ServerLimits& limits,
                                               const Security& security, CheckRequest check,
                                               OnRequest run_inline, OnRequest offload,
                                               std::shared_ptr<const Settings> settings) {
    auto s = std::shared_ptr<SameHostServer>(new SameHostServer(
        limits, security, std::move(check), std::move(run_inline), std::move(offload),
        std::move(settings)));
    static std::atomic<int> counter{0};
    s->name_ = absl::StrCat("ddprpc.", getpid(), ".", counter.fetch_add(1), ".",
                            Security::random_token().substr(0, 16));
    s->listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    s->reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    sockaddr_un addr;
    socklen_t len;
    set_abstract_address(s->name_, &addr, &len);
    epoll_event poke{};
    poke.events = EPOLLIN;
    poke.data.u64 = kPokeKey;
    if (s->listen_fd_ < 0 || bind(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
        listen(s->listen_fd_, 1024) != 0 || s->epoll_fd_ < 0 || s->poke_fd_ < 0 ||
        epoll_ctl(s->epoll_fd_, EPOLL_CTL_ADD, s->poke_fd_, &poke) != 0) {
      LOG(WARNING) << "rpc: no same-host endpoint (" << std::strerror(errno) << "); peers on this "
                   << "host connect over the network";
      if (s->listen_fd_ >= 0) ::close(s->listen_fd_);
      return nullptr;
    }
    s->stop_fd_ = eventfd(0, EFD_CLOEXEC);
    {
      absl::MutexLock lock(&s->mu_);
      s->spawn_thread([self = s.get()](int64_t me) { self->reading_thread(me); });
    }
    s->acceptor_ = std::thread([self = s.get()] {
      rpc::internal::apply_thread_policy(self->settings_->options.batch_scheduling);
      self->accept_loop();
    });
    s->watchdog_ = std::thread([self = s.get()] {
      rpc::internal::apply_thread_policy(self->settings_->options.batch_scheduling);
      self->watchdog_loop();
    });
    return s;
  }

  // shutdown() must have been called (its threads hold it).
  ~SameHostServer() {
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    if (poke_fd_ >= 0) ::close(poke_fd_);
    if (reserve_fd_ >= 0) ::close(reserve_fd_);
  }

  const std::string& name() const { return name_; }

  void shutdown(absl::Duration grace) {
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return;
      stopping_ = true;
    }
    uint64_t one = 1;
    ssize_t ignored = ::write(stop_fd_, &one, sizeof(one));
    (void)ignored;
    if (acceptor_.joinable()) acceptor_.join();
    // Connections still open get `grace` to answer what they have read.
    const absl::Time deadline = absl::Now() + grace;
    std::vector<std::shared_ptr<ServerConn>> conns;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [key, c] : conns_) conns.push_back(c);
    }
    for (auto& c : conns) {
      absl::MutexLock lock(&c->mu);
      auto answered = [&c]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu) { return c->unanswered == 0; };
      c->mu.AwaitWithDeadline(absl::Condition(&answered), deadline);
    }
    for (auto& c : conns) {
      c->conn->send_control(kGoodbye, 0, 0);
      c->conn->shutdown_after_flush(absl::Milliseconds(100));
    }
    {
      absl::MutexLock lock(&mu_);
      threads_stop_ = true;
    }
    poke();
    if (watchdog_.joinable()) watchdog_.join();
    absl::MutexLock lock(&mu_);
    auto gone = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return threads_ == 0; };
    mu_.Await(absl::Condition(&gone));
    conns_.clear();
    ready_.clear();
    stopped_ = true;
    ::close(listen_fd_);
    ::close(stop_fd_);
  }

 private:
  SameHostServer(const ServerLimits& limits, const Security& security, CheckRequest check,
                 OnRequest run_inline, OnRequest offload, std::shared_ptr<const Settings> settings)
      : limits_(limits),
        settings_(std::move(settings)),
        security_(security),
        auth_(security.authenticated() ? std::make_unique<internal::AuthChecker>(security.token)
                                       : nullptr),
        check_(std::move(check)),
        run_inline_(std::move(run_inline)),
        offload_(std::move(offload)),
        epoll_fd_(epoll_create1(EPOLL_CLOEXEC)),
        poke_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
        streams_of_worker_(std::max(limits.world_size, 1), 0),
        buffered_of_worker_(std::max(limits.world_size, 1), 0) {}

  static constexpr int kMaxHandedOff = 64;
  // The watchdog parks after this long without a message, and looks at
  // most this often.
  static constexpr absl::Duration kIdle = absl::Milliseconds(100);
  static constexpr absl::Duration kMinLook = absl::Milliseconds(1);
  static constexpr uint64_t kPokeKey = 0;  // epoll data of poke_fd_; connections count from 1
  static constexpr int kMaxEvents = 32;
  // Messages the role holder serves of one connection before it looks at
  // the others again.
  static constexpr int kFairShare = 16;
  // Threads without the role that wait for it; more leave.
  static constexpr int kMaxIdleThreads = 2;

  // What became of a connection after one message, or after finding none.
  enum class Next {
    kMore,   // still this thread's: it may have another message
    kIdle,   // given back (armed, or parked while paused)
    kEnded,  // closed and forgotten
    kMoved,  // the watchdog gave it, with the role, to another thread
  };

  // A connection in its handshake, read by the acceptor alone: nothing it
  // sends before its hello is proven reaches any other thread.
  struct Handshake {
    int fd = -1;
    uid_t uid = static_cast<uid_t>(-1);
    pid_t pid = 0;
    absl::Time deadline;
    Preamble preamble;
    size_t got = 0;    // bytes of the preamble, then of the body, read so far
    std::string body;  // sized once the preamble is checked
    bool done = false;  // taken out of the table (admitted, refused or dropped)
  };

  // The acceptor: takes new connections and runs every handshake itself,
  // each socket read without blocking as its bytes come, so that
  // connections that send nothing cost a descriptor and a slot in the
  // table of handshakes (bounded, see ServerLimits), not a thread.
  void accept_loop() {
    std::deque<std::unique_ptr<Handshake>> open;  // oldest first
    absl::Time listen_after = absl::InfinitePast();
    std::vector<pollfd> fds;
    for (;;) {
      const absl::Time now = absl::Now();
      for (auto& h : open) {
        if (h->deadline <= now) drop(h.get(), "its handshake timed out");
      }
      forget_done(&open);
      fds.clear();
      fds.push_back({stop_fd_, POLLIN, 0});
      fds.push_back({now >= listen_after ? listen_fd_ : -1, POLLIN, 0});
      for (auto& h : open) fds.push_back({h->fd, POLLIN, 0});
      absl::Time wake = listen_after > now ? listen_after : absl::InfiniteFuture();
      for (auto& h : open) wake = std::min(wake, h->deadline);
      const int timeout_ms =
          wake == absl::InfiniteFuture()
              ? -1
              : static_cast<int>(std::max<int64_t>(absl::ToInt64Milliseconds(wake - now), 0) + 1);
      const int r = poll(fds.data(), fds.size(), timeout_ms);
      if (r < 0) {
        if (errno != EINTR) {
          LOG_EVERY_N(WARNING, 100) << "rpc same-host transport: poll: " << std::strerror(errno);
          absl::SleepFor(absl::Milliseconds(10));
        }
        continue;
      }
      if (fds[0].revents) break;
      // Hellos that have come are taken before new connections, which may
      // push the oldest handshakes out. Nothing thrown here (no memory)
      // leaves the thread: the connection at hand is dropped.
      for (size_t i = 2; i < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        Handshake* h = open[i - 2].get();
        try {
          read_handshake(h);
        } catch (const std::exception& e) {
          LOG_EVERY_N(ERROR, 100) << "rpc same-host transport: a handshake failed: " << e.what();
          drop(h, "its handshake failed");
        }
      }
      forget_done(&open);
      if (fds[1].revents & POLLIN) {
        try {
          accept_some(&open, &listen_after);
        } catch (const std::exception& e) {
          LOG_EVERY_N(ERROR, 100) << "rpc same-host transport: accepting failed: " << e.what();
          listen_after = absl::Now() + absl::Milliseconds(10);
        }
      }
    }
    for (auto& h : open) ::close(h->fd);
  }

  static void forget_done(std::deque<std::unique_ptr<Handshake>>* open) {
    open->erase(std::remove_if(open->begin(), open->end(),
                               [](const std::unique_ptr<Handshake>& h) { return h->done; }),
                open->end());
  }

  // Ends a connection still in its handshake, without a word.
  void drop(Handshake* h, const char* why) {
    if (h->done) return;
    VLOG(1) << "rpc same-host transport: dropping a connection of uid " << h->uid << " (pid "
            << h->pid << "): " << why;
    ::close(h->fd);
    h->done = true;
  }

  // Takes the connections waiting to be accepted (some at a time).
  void accept_some(std::deque<std::unique_ptr<Handshake>>* open, absl::Time* listen_after) {
    for (int i = 0; i < 64; ++i) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors (or memory): the new connection alone fails.
          // The reserve descriptor lets it be taken off the queue and
          // closed; without one, the queue waits a little.
          LOG_EVERY_N(WARNING, 100) << "rpc same-host transport: cannot accept a connection: "
                                    << std::strerror(errno);
          if (reserve_fd_ >= 0) {
            ::close(reserve_fd_);
            const int taken = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
            if (taken >= 0) ::close(taken);
            reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
            if (taken >= 0) continue;
          }
          *listen_after = absl::Now() + absl::Milliseconds(10);
        }
        return;
      }
      uid_t uid = static_cast<uid_t>(-1);
      const pid_t pid = peer_pid_of(fd, &uid);
      if (pid <= 0 || (uid != geteuid() && !limits_.allow_other_uids)) {
        // Refused before anything it sends is read; nothing is said.
        LOG_EVERY_N(WARNING, 100) << "rpc same-host transport: refusing a connection of uid "
                                  << static_cast<int64_t>(pid <= 0 ? -1 : uid)
                                  << " (another user; see ServerLimits::allow_other_uids)";
        ::close(fd);
        continue;
      }
      // Room for it: the oldest handshake of its uid, else the oldest of
      // all, gives way.
      const int total_cap = std::max(limits_.max_unauthenticated_connections, 1);
      const int uid_cap = std::max(limits_.max_unauthenticated_per_peer, 1);
      int of_uid = 0;
      Handshake* oldest_of_uid = nullptr;
      for (auto& h : *open) {
        if (h->uid != uid) continue;
        if (!oldest_of_uid) oldest_of_uid = h.get();
        ++of_uid;
      }
      if (of_uid >= uid_cap) {
        drop(oldest_of_uid, "too many handshakes of its uid");
        forget_done(open);
      }
      if (static_cast<int>(open->size()) >= total_cap) {
        drop(open->front().get(), "too many handshakes");
        forget_done(open);
      }
      auto h = std::make_unique<Handshake>();
      h->fd = fd;
      h->uid = uid;
      h->pid = pid;
      h->deadline = absl::Now() + limits_.handshake_timeout;
      open->push_back(std::move(h));
    }
  }

  // Reads what a handshake's socket holds, no more than the hello; admits
  // or refuses it once the hello is whole.
  void read_handshake(Handshake* h) {
    const size_t head = sizeof(Preamble);
    for (;;) {
      char* dst;
      size_t want;
      if (h->got < head) {
        dst = reinterpret_cast<char*>(&h->preamble) + h->got;
        want = head - h->got;
      } else {
        dst = h->body.data() + (h->got - head);
        want = h->body.size() - (h->got - head);
      }
      const ssize_t n = recv(h->fd, dst, want, MSG_DONTWAIT);
      if (n == 0) return drop(h, "it closed");
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        return drop(h, "reading it failed");
      }
      h->got += static_cast<size_t>(n);
      if (h->got == head) {
        const Preamble& p = h->preamble;
        if (p.magic != kMagic || p.kind != kHello || p.body < sizeof(HelloBody) ||
            p.body > kMaxHandshakeBody) {
          return drop(h, "it did not start with a hello");
        }
        h->body.assign(p.body, '\0');
      }
      if (h->got > head && h->got == head + h->body.size()) return finish_handshake(h);
    }
  }

  // The hello of `h` is whole: checks it and welcomes the connection into
  // the epoll set, or refuses it.
  void finish_handshake(Handshake* h) {
    h->done = true;
    HelloBody hello;
    std::memcpy(&hello, h->body.data(), sizeof(hello));
    if (hello.proof_size != h->body.size() - sizeof(hello)) {
      VLOG(1) << "rpc same-host transport: a malformed hello (pid " << h->pid << ")";
      ::close(h->fd);
      return;
    }
    // What a refused peer is told names nothing of the job (no worker
    // ids, counts or addresses); the log says more.
    absl::Status verdict;
    std::string detail;
    if (hello.worker < 0 || hello.worker >= limits_.world_size) {
      verdict = absl::PermissionDeniedError("the connection names no worker of this job");
      detail = absl::StrCat("worker ", hello.worker, " is not in [0, ", limits_.world_size, ")");
    } else if (auth_) {
      grpc::Status proven = auth_->check_proof(
          absl::string_view(h->body.data() + sizeof(hello), hello.proof_size),
          {"rpc", "same-host", hello.worker, limits_.self});
      if (!proven.ok()) verdict = absl::UnauthenticatedError(proven.error_message());
    } else if (security_.encrypted() && h->uid != getuid()) {
      verdict = absl::UnauthenticatedError(
          "a same-host connection of another user to a job without a token");
    }
    std::shared_ptr<ServerConn> c;
    std::shared_ptr<ServerConn> replaced;
    if (verdict.ok()) {
      absl::MutexLock lock(&mu_);
      if (stopping_) {
        verdict = absl::UnavailableError("the server is shutting down");
      } else {
        if (streams_of_worker_[hello.worker] >= std::max(limits_.max_streams_per_worker, 1)) {
          // The newest proven connection of a worker wins: its oldest gives
          // way, so connections left behind (or taken by another holder of
          // the token) cannot keep the worker out.
          for (auto& [key, other] : conns_) {
            if (other->caller == hello.worker) {
              replaced = other;
              break;  // keys grow: the first is the oldest
            }
          }
          if (replaced) {
            conns_.erase(replaced->key);
            --streams_of_worker_[hello.worker];
          }
        }
        if (streams_of_worker_[hello.worker] >= std::max(limits_.max_streams_per_worker, 1)) {
          verdict = absl::ResourceExhaustedError("too many connections name this worker");
          detail = absl::StrCat("worker ", hello.worker, " has ",
                                streams_of_worker_[hello.worker], " connections open already");
        } else {
          ++streams_of_worker_[hello.worker];
          c = std::make_shared<ServerConn>(next_key_++, h->uid);
        }
      }
    }
    if (replaced) {
      LOG(WARNING) << "rpc same-host transport: a newer connection of worker " << hello.worker
                   << " replaces " << replaced->address;
      epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, replaced->conn->fd(), nullptr);
      replaced->conn->send_control(kGoodbye, 0, 0,
                                   "replaced by a newer connection of the same worker");
      replaced->conn->shutdown_after_flush(absl::Milliseconds(100));
    }
    WelcomeBody welcome;
    welcome.code = static_cast<int32_t>(verdict.code());
    const std::string message(verdict.message());
    welcome.message_size = static_cast<uint32_t>(message.size());
    std::string reply(sizeof(Preamble) + sizeof(welcome), '\0');
    if (!c) {
      // The probe's address and whether this end can read the caller's
      // memory are for admitted callers only.
      LOG_EVERY_N(WARNING, 100) << "rpc same-host transport: refusing a connection of pid "
                                << h->pid << ": "
                                << (detail.empty() ? message : detail);
      Preamble p;
      p.kind = kWelcome;
      p.body = static_cast<uint32_t>(sizeof(welcome) + message.size());
      std::memcpy(reply.data(), &p, sizeof(p));
      std::memcpy(reply.data() + sizeof(p), &welcome, sizeof(welcome));
      reply += message;
      ssize_t ignored = send(h->fd, reply.data(), reply.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      (void)ignored;
      ::close(h->fd);
      return;
    }
    // A wake of the connection (a reply while it is paused, or a write
    // that found its socket full) pokes the role holder.
    c->conn = std::make_unique<Conn>(
        h->fd, h->pid, limits_.max_message_bytes, limits_.keepalive_interval,
        limits_.keepalive_timeout,
        [server = weak_from_this(), conn = c.get()] {
          conn->poked.store(true);
          if (auto s = server.lock()) s->poke();
        },
        limits_.max_pending_reply_bytes);
    c->caller = hello.worker;
    c->address = absl::StrCat("same-host process ", h->pid, " (worker ", hello.worker, ")");
    welcome.probe = reinterpret_cast<uint64_t>(kProbe);
    welcome.cross_memory = can_read_remote(h->pid, hello.probe);
    std::string body(sizeof(welcome), '\0');
    std::memcpy(body.data(), &welcome, sizeof(welcome));
    c->conn->send_control(kWelcome, 0, 0, body);
    c->conn->start_reading_ahead();
    {
      absl::MutexLock lock(&c->mu);
      c->reader = kNobody;
    }
    {
      absl::MutexLock lock(&mu_);
      conns_.emplace(c->key, c);
    }
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
    ev.data.u64 = c->key;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, c->conn->fd(), &ev) != 0) {
      reject(c.get(), absl::InternalError(absl::StrCat("epoll: ", std::strerror(errno))));
      end(c);
    }
  }

  // Starts a thread running `body` with its id; it holds the server. False
  // (logged) when none can start.
  bool spawn_thread(std::function<void(int64_t)> body) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t me = next_thread_++;
    try {
      internal::fault_point("transport.spawn_thread");
      std::thread([self = shared_from_this(), me, body = std::move(body)] {
        rpc::internal::apply_thread_policy(self->settings_->options.batch_scheduling);
        body(me);
        absl::MutexLock lock(&self->mu_);
        --self->threads_;
      }).detach();
    } catch (const std::exception& e) {
      LOG(ERROR) << "rpc same-host transport: cannot start a thread: " << e.what();
      return false;
    }
    ++threads_;
    return true;
  }

  // Wakes the role holder to look at the poked connections (and at
  // threads_stop_).
  void poke() {
    uint64_t one = 1;
    ssize_t ignored = ::write(poke_fd_, &one, sizeof(one));
    (void)ignored;
  }

  // A thread that serves connections: it waits for the role, holds it
  // until the watchdog gives it to another thread (while a message keeps
  // this one), then waits again, or leaves when enough threads wait.
  void reading_thread(int64_t me) {
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        ++idle_;
        auto can_hold = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return role_free_ || threads_stop_;
        };
        mu_.Await(absl::Condition(&can_hold));
        --idle_;
        if (threads_stop_) return;
        role_free_ = false;
        holder_ = me;
      }
      hold_role(me);
      absl::MutexLock lock(&mu_);
      if (threads_stop_ || idle_ >= kMaxIdleThreads) return;
    }
  }

  void hold_role(int64_t me) {
    for (;;) {
      std::shared_ptr<ServerConn> c;
      bool sweep = false;
      {
        absl::MutexLock lock(&mu_);
        if (holder_ != me || threads_stop_) return;
        c = take_ready(me);
        const absl::Time now = absl::Now();
        if (!c && now >= next_sweep_) {
          next_sweep_ = now + limits_.keepalive_interval;
          sweep = true;
        }
      }
      if (c) {
        if (!serve(c, me)) return;
      } else if (sweep) {
        check_peers(me);
      } else {
        wait_for_events(/*block=*/true);
      }
    }
  }

  // The next queued connection nobody reads, now read by `me`.
  std::shared_ptr<ServerConn> take_ready(int64_t me) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (!ready_.empty()) {
      const uint64_t key = ready_.front();
      ready_.pop_front();
      auto it = conns_.find(key);
      if (it == conns_.end()) continue;
      it->second->queued = false;
      absl::MutexLock conn_lock(&it->second->mu);
      // Another thread reads it and gives it back when done.
      if (it->second->reader != kNobody) continue;
      it->second->reader = me;
      return it->second;
    }
    return nullptr;
  }

  // Queues the connections that have an event and those poked; with
  // `block`, waits for one first (spinning before it sleeps where that
  // pays), or for keepalive_interval.
  void wait_for_events(bool block) {
    epoll_event events[kMaxEvents];
    int n;
    if (!block) {
      n = epoll_wait(epoll_fd_, events, kMaxEvents, 0);
    } else {
      const int timeout_ms =
          static_cast<int>(absl::ToInt64Milliseconds(limits_.keepalive_interval) + 1);
      const int64_t spin_ns = settings_->spin_ns.load(std::memory_order_relaxed);
      if (spin_ns > 0) {
        pollfd p{epoll_fd_, POLLIN, 0};
        n = SpinPoll::this_thread(spin_ns).poll(&p, 1, timeout_ms) > 0
                ? epoll_wait(epoll_fd_, events, kMaxEvents, 0)
                : 0;
      } else {
        n = epoll_wait(epoll_fd_, events, kMaxEvents, timeout_ms);
      }
    }
    bool poked = false;
    absl::MutexLock lock(&mu_);
    for (int i = 0; i < n; ++i) {
      if (events[i].data.u64 == kPokeKey) {
        poked = true;
        continue;
      }
      auto it = conns_.find(events[i].data.u64);
      if (it != conns_.end()) queue_locked(it->second.get());
    }
    if (!poked) return;
    uint64_t v;
    ssize_t ignored = ::read(poke_fd_, &v, sizeof(v));
    (void)ignored;
    for (auto& [key, c] : conns_) {
      if (c->poked.exchange(false)) queue_locked(c.get());
    }
  }

  // Looks at the process behind every connection nobody reads (a caller
  // that stopped or died while idle, or while its connection is paused).
  void check_peers(int64_t me) {
    std::vector<std::shared_ptr<ServerConn>> idle;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [key, c] : conns_) {
        absl::MutexLock conn_lock(&c->mu);
        if (c->reader != kNobody) continue;
        c->reader = me;
        idle.push_back(c);
      }
    }
    for (auto& c : idle) {
      absl::Status alive = c->conn->check_peer_alive();
      if (!alive.ok()) {
        set_busy(c, me);  // ending may wait for writes to go out
        finish(c, alive, /*clean=*/false);
        clear_busy(me);
        continue;
      }
      absl::MutexLock lock(&c->mu);
      c->reader = kNobody;  // its arming is as it was
    }
  }

  // Serves `c` (read by `me`) until it has no message, is paused, ended or
  // taken away, or had its share; false when `me` lost the role.
  bool serve(const std::shared_ptr<ServerConn>& c, int64_t me) {
    for (int served = 0;;) {
      const Next next = step(c, me, /*after_message=*/served > 0);
      bool lost;
      {
        absl::MutexLock lock(&mu_);
        lost = holder_ != me;
      }
      if (next != Next::kMore) return !lost && next != Next::kMoved;
      if (lost || ++served >= kFairShare) {
        // Behind the others that have come meanwhile.
        if (!lost) wait_for_events(/*block=*/false);
        requeue(c, me, /*wake=*/lost);
        return !lost;
      }
    }
  }

  // One message of `c`, or none: the connection's next state.
  // `after_message`: this thread served one of `c` just before.
  Next step(const std::shared_ptr<ServerConn>& c, int64_t me, bool after_message) {
    Conn* conn = c->conn.get();
    bool want_out = false;
    absl::Status why = conn->flush_for_reader(&want_out);
    if (!why.ok()) return finish(c, why, /*clean=*/false);
    // Tensors lent and not yet acknowledged do not pause reading (the
    // acknowledgements come on this socket); the Conn lends no more than
    // max_pending_reply_bytes and sends the rest inline, which queues here.
    const bool full = conn->queued_bytes() > limits_.max_pending_reply_bytes;
    {
      absl::MutexLock lock(&c->mu);
      c->paused = full || c->unanswered >= limits_.max_pending_requests;
      if (c->paused) {
        // Its replies going out poke it; room to write wakes it here.
        c->reader = kNobody;
        if (want_out) arm(c.get(), EPOLLOUT);
        return Next::kIdle;
      }
    }
    bool would_block = false;
    bool eof = false;
    // After a message that left nothing read and unused, bytes that came
    // since show when the connection is armed again: no read to find none.
    if (after_message && conn->drained()) {
      would_block = true;
    } else {
      why = conn->fill(&would_block, &eof);
      if (!why.ok()) return finish(c, why, /*clean=*/eof);
    }
    if (would_block) {
      {
        absl::MutexLock lock(&c->mu);
        c->reader = kNobody;
      }
      arm(c.get(), EPOLLIN | EPOLLRDHUP | (want_out ? EPOLLOUT : 0));
      return Next::kIdle;
    }
    // A message, or its start, is here; the rest may take a while.
    set_busy(c, me);
    Preamble p;
    why = read_preamble(conn, &p, &eof);
    bool clean = eof;  // a caller that closed without saying goodbye
    bool moved = false;
    if (why.ok()) {
      if (p.kind == kFrame) {
        try {
          internal::fault_point("transport.server_read");
          why = on_frame(c, p, me, &moved);
        } catch (const std::exception& e) {
          why = absl::InternalError(absl::StrCat("rpc transport: ", e.what()));
        }
      } else if (p.kind == kAck && p.body == 0) {
        why = conn->on_ack(p.seq);
      } else if (p.kind == kConfirm && p.body == 0) {
        conn->set_may_send_remote(p.flags & kFlagCrossMemory);
      } else if (p.kind == kGoodbye && p.body == 0) {
        why = absl::CancelledError("goodbye");
        clean = true;
      } else {
        why = absl::DataLossError(absl::StrCat("unexpected message kind ", int{p.kind}));
      }
    }
    if (moved) {
      // Not ours any more: its reader ends it once it finds it shut.
      if (!why.ok()) {
        reject(c.get(), why);
        c->conn->shutdown();
      }
      return Next::kMoved;
    }
    if (why.ok()) {
      clear_busy(me);
      return Next::kMore;
    }
    const Next next = finish(c, why, clean);
    clear_busy(me);
    return next;
  }

  absl::Status on_frame(const std::shared_ptr<ServerConn>& c, const Preamble& p, int64_t me,
                        bool* moved) {
    Frame frame;
    // What the frame claims counts against the receive budgets while it is
    // read (a claim past 64 bits or max_message_bytes is refused by
    // read_frame before anything is allocated).
    uint64_t claim = p.body;
    if (__builtin_add_overflow(claim, p.inline_bytes, &claim) ||
        __builtin_add_overflow(claim, p.remote_bytes, &claim)) {
      claim = 0;
    }
    claim = std::min<uint64_t>(claim, static_cast<uint64_t>(limits_.max_message_bytes) + 1);
    absl::Status ok = reserve_receive(c->caller, static_cast<int64_t>(claim));
    if (!ok.ok()) return ok;
    ok = c->conn->read_frame(p, &frame);
    release_receive(c->caller, static_cast<int64_t>(claim));
    if (!ok.ok()) return ok;
    capture(*settings_, "request", frame);
    if (p.num_remote > 0) c->conn->send_control(kAck, 0, p.seq);
    ok = check_(c->caller, frame);
    if (!ok.ok()) return ok;
    auto responder = std::make_shared<SameHostResponder>(c);
    {
      absl::MutexLock lock(&c->mu);
      ++c->unanswered;
    }
    bool run_here;
    {
      absl::MutexLock lock(&mu_);
      // A thread that lost the role runs nothing more.
      run_here = !frame.more_in_flight && handed_off_ < kMaxHandedOff && holder_ == me;
      if (run_here) busy_running_ = true;
    }
    if (run_here) note_inline_run();
    try {
      if (run_here) {
        run_inline_(std::move(responder), std::move(frame));
      } else {
        offload_(std::move(responder), std::move(frame));
      }
    } catch (const std::exception& e) {
      ok = absl::InternalError(absl::StrCat("serving a request failed: ", e.what()));
    } catch (...) {
      ok = absl::InternalError("serving a request failed");
    }
    if (run_here) {
      // One look: either the watchdog took the role during the run (and
      // counted it as handed off), or from here on it sees no run to take.
      absl::MutexLock lock(&mu_);
      if (holder_ != me) {
        --handed_off_;
        absl::MutexLock conn_lock(&c->mu);
        *moved = c->reader != me;
      } else {
        clear_busy_locked();
      }
    }
    return ok;
  }

  // Counts `bytes` of a frame of worker `caller` being read against the
  // budgets of that worker and of all; ResourceExhausted past either.
  absl::Status reserve_receive(int caller, int64_t bytes) {
    const int64_t per_peer = limits_.max_buffered_bytes_per_peer > 0
                                 ? limits_.max_buffered_bytes_per_peer
                                 : limits_.max_message_bytes;
    absl::MutexLock lock(&budget_mu_);
    if (buffered_ + bytes > limits_.max_buffered_bytes ||
        buffered_of_worker_[caller] + bytes > per_peer) {
      LOG_EVERY_N(WARNING, 100) << "rpc same-host transport: a frame of " << bytes
                                << " bytes from worker " << caller << " would pass the receive "
                                << "budget (" << buffered_of_worker_[caller] << " of " << per_peer
                                << " for the worker, " << buffered_ << " of "
                                << limits_.max_buffered_bytes << " in all)";
      return absl::ResourceExhaustedError(
          "a frame would pass the receiver's budget of bytes being received "
          "(max_buffered_bytes, max_buffered_bytes_per_peer)");
    }
    buffered_ += bytes;
    buffered_of_worker_[caller] += bytes;
    return absl::OkStatus();
  }
  void release_receive(int caller, int64_t bytes) {
    absl::MutexLock lock(&budget_mu_);
    buffered_ -= bytes;
    buffered_of_worker_[caller] -= bytes;
  }

  // Re-arms `c` (nobody reads it now) for `events`, once.
  void arm(ServerConn* c, uint32_t events) {
    epoll_event ev{};
    ev.events = events | EPOLLONESHOT;
    ev.data.u64 = c->key;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c->conn->fd(), &ev) != 0) {
      // Only a connection that is being closed has no registration.
      LOG(WARNING) << "rpc same-host transport: epoll of " << c->address << ": "
                   << std::strerror(errno);
    }
  }

  // Gives `c`, which `me` reads, back to the queue of the role (poking the
  // holder when it is another thread, which may sleep).
  void requeue(const std::shared_ptr<ServerConn>& c, int64_t me, bool wake) {
    {
      absl::MutexLock lock(&mu_);
      absl::MutexLock conn_lock(&c->mu);
      if (c->reader != me) return;
      c->reader = kNobody;
      queue_locked(c.get());
    }
    if (wake) poke();
  }

  // Puts `c` in ready_ unless it is there already: one entry per
  // connection, whatever events and pokes it gets.
  void queue_locked(ServerConn* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (c->queued) return;
    c->queued = true;
    ready_.push_back(c->key);
  }

  // The role holder `me` is on a message of `c` from now (reading it; then
  // on_frame marks the run of its request), or on none.
  void set_busy(const std::shared_ptr<ServerConn>& c, int64_t me) {
    {
      absl::MutexLock lock(&mu_);
      if (holder_ != me) return;
      busy_since_ = absl::Now();
      busy_conn_ = c;
      busy_running_ = false;
    }
    note_inline_run();
  }
  void clear_busy(int64_t me) {
    absl::MutexLock lock(&mu_);
    if (holder_ == me) clear_busy_locked();
  }
  void clear_busy_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    busy_since_ = absl::InfiniteFuture();
    busy_conn_.reset();
    busy_running_ = false;
  }

  // Ends `c` (saying why to a caller that broke a rule) and forgets it.
  Next finish(const std::shared_ptr<ServerConn>& c, const absl::Status& why, bool clean) {
    if (!clean && !why.ok() && !absl::IsCancelled(why) && !c->conn->peer_closed()) {
      reject(c.get(), why);
      c->conn->send_control(kGoodbye, 0, 0, std::string(why.message()).substr(0, kMaxHandshakeBody));
    }
    end(c);
    return Next::kEnded;
  }

  // The watchdog: gives the role to another thread when a message has kept
  // the holder for inline_handoff. It looks when the message it saw would
  // be overdue, or inline_handoff after it saw none (no message that
  // starts later is overdue before that), and parks once kIdle has passed
  // without a message; a message that finds it parked wakes it
  // (note_inline_run). So the messages of a busy server wake it at most
  // once per inline_handoff and take the server's mutex only for their
  // own marks.
  void watchdog_loop() {
    absl::MutexLock lock(&mu_);
    absl::Time last_message = absl::Now();
    while (!threads_stop_) {
      const absl::Time now = absl::Now();
      if (now - last_message >= kIdle) {
        watchdog_parked_.store(true);
        // A message that started before the store above and was not seen
        // by the last look would not wake the watchdog: look once more.
        if (busy_since_ == absl::InfiniteFuture()) {
          auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
            return threads_stop_ || !watchdog_parked_.load();
          };
          mu_.Await(absl::Condition(&wake));
          if (threads_stop_) return;
        }
        watchdog_parked_.store(false);
        last_message = absl::Now();
      }
      const absl::Duration wait =
          busy_since_ == absl::InfiniteFuture()
              ? limits_.inline_handoff
              : std::max(busy_since_ + limits_.inline_handoff - now, kMinLook);
      mu_.AwaitWithTimeout(absl::Condition(&threads_stop_), wait);
      if (threads_stop_) return;
      if (hand_off_overdue() || messages_since_look_.exchange(false)) last_message = absl::Now();
    }
  }

  // Gives the role to another thread if the holder has been on one message
  // for inline_handoff, and the connection too if it runs that message's
  // request; returns whether the holder is on a message.
  bool hand_off_overdue() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (busy_since_ == absl::InfiniteFuture()) return false;
    if (absl::Now() - busy_since_ < limits_.inline_handoff) return true;
    if (busy_running_) {
      ++handed_off_;
      absl::MutexLock conn_lock(&busy_conn_->mu);
      busy_conn_->reader = kNobody;
      // First in the queue (moved there if it was queued already).
      if (busy_conn_->queued) {
        auto at = std::find(ready_.begin(), ready_.end(), busy_conn_->key);
        if (at != ready_.end()) ready_.erase(at);
      }
      busy_conn_->queued = true;
      ready_.push_front(busy_conn_->key);
    }
    clear_busy_locked();
    holder_ = kNobody;
    role_free_ = true;
    if (idle_ == 0) spawn_thread([self = this](int64_t me) { self->reading_thread(me); });
    return true;
  }

  // Keeps the watchdog ticking while messages come, and wakes it if it
  // parked.
  void note_inline_run() {
    messages_since_look_.store(true, std::memory_order_relaxed);
    // Sequentially consistent with the watchdog's store before it looks at
    // the holder: either it sees this message, or this sees it parked.
    if (watchdog_parked_.load()) {
      absl::MutexLock lock(&mu_);
      watchdog_parked_.store(false);
    }
  }

  void reject(ServerConn* c, const absl::Status& why) {
    LOG(WARNING) << "rpc same-host transport: ending the connection of " << c->address << ": "
                 << why.message();
  }

  void end(const std::shared_ptr<ServerConn>& c) {
    // Not in the set (its handshake failed, or it is ending anyway): no-op.
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->conn->fd(), nullptr);
    c->conn->shutdown_after_flush(absl::Milliseconds(100));
    absl::MutexLock lock(&mu_);
    if (conns_.erase(c->key) > 0 && c->caller >= 0) --streams_of_worker_[c->caller];
  }

  const ServerLimits limits_;
  const std::shared_ptr<const Settings> settings_;
  const Security security_;
  const std::unique_ptr<internal::AuthChecker> auth_;
  const CheckRequest check_;
  const OnRequest run_inline_;
  const OnRequest offload_;
  const int epoll_fd_;  // every connection nobody reads, armed for one event
  const int poke_fd_;   // in the set: wakes the role holder
  std::string name_;
  int listen_fd_ = -1;
  int stop_fd_ = -1;
  // Held to be let go when descriptors run out (see accept_some).
  int reserve_fd_ = -1;
  std::thread acceptor_;
  std::thread watchdog_;

  absl::Mutex mu_;
  // State below is protected by mu_.
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool threads_stop_ ABSL_GUARDED_BY(mu_) = false;  // reading threads and the watchdog leave
  std::map<uint64_t, std::shared_ptr<ServerConn>> conns_ ABSL_GUARDED_BY(mu_);
  uint64_t next_key_ ABSL_GUARDED_BY(mu_) = kPokeKey + 1;
  std::vector<int> streams_of_worker_ ABSL_GUARDED_BY(mu_);
  int threads_ ABSL_GUARDED_BY(mu_) = 0;  // running reading threads
  int idle_ ABSL_GUARDED_BY(mu_) = 0;     // reading threads waiting for the role
  int64_t next_thread_ ABSL_GUARDED_BY(mu_) = 1;
  bool role_free_ ABSL_GUARDED_BY(mu_) = true;
  int64_t holder_ ABSL_GUARDED_BY(mu_) = kNobody;
  // Connections for the holder to serve before it waits, each at most once
  // (its `queued`).
  std::deque<uint64_t> ready_ ABSL_GUARDED_BY(mu_);
  absl::Time next_sweep_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // The message the holder is on, since when, and whether it runs it.
  absl::Time busy_since_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::shared_ptr<ServerConn> busy_conn_ ABSL_GUARDED_BY(mu_);
  bool busy_running_ ABSL_GUARDED_BY(mu_) = false;
  // Requests that still run on threads that lost the role to the watchdog.
  int handed_off_ ABSL_GUARDED_BY(mu_) = 0;
  // Bytes of frames being read (see reserve_receive).
  absl::Mutex budget_mu_;
  int64_t buffered_ ABSL_GUARDED_BY(budget_mu_) = 0;
  std::vector<int64_t> buffered_of_worker_ ABSL_GUARDED_BY(budget_mu_);
  // Set by every message; each look of the watchdog clears it.
  std::atomic<bool> messages_since_look_{false};
  // Written under mu_ (read without it by note_inline_run).
  std::atomic<bool> watchdog_parked_{false};
};

// ------------------------------------------------------------ channel

class SameHostChannel;

// This thread's eventfd for ReadGate::driver_fds (made at its first
// drive_same_host).
thread_local int t_driver_fd = -1;

// Who reads the replies of a transport's channels. A channel's socket is
// read by one thread at a time, the holder of its reading role: a caller
// waiting for a reply (SameHostTransport::drive), so that the reply wakes
// only that caller, or else the channel's background thread, which reads
// while replies are expected, no caller holds reservations (SyncCallScope:
// callers that will wait and read) and no caller holds the role.
//
// Reservations are made for both transports at once (a scope does not know
// which its calls will use), so a thread that waits on one transport lends
// its reservations of the other back for the wait (Lend): a reply of the
// other kind that its wait depends on is then read by that transport's own
// background reader.
struct ReadGate {
  Transport* fallback = nullptr;  // set once, before any channel exists
  std::shared_ptr<Settings> settings;  // likewise
  absl::Mutex mu;
  // State below is protected by mu.
  int reserved ABSL_GUARDED_BY(mu) = 0;
  // Moves when a role is let go or a reply has been handled.
  uint64_t version ABSL_GUARDED_BY(mu) = 0;
  // Eventfds of the threads in drive_same_host: a reply handled anywhere
  // (either transport) wakes them to look at their done().
  std::vector<int> driver_fds ABSL_GUARDED_BY(mu);
  // All but the calling thread's: a driver that handled the reply itself
  // looks at its done() before it waits again.
  void wake_drivers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const uint64_t one = 1;
    for (int fd : driver_fds) {
      if (fd == t_driver_fd) continue;
      ssize_t ignored = ::write(fd, &one, sizeof(one));
      (void)ignored;
    }
  }
  std::vector<std::weak_ptr<SameHostChannel>> channels ABSL_GUARDED_BY(mu);
};

// Reads the same-host channels whose role is free (or held by this thread
// further up) until done() or `deadline`.
void drive_same_host(const std::shared_ptr<ReadGate>& gate, const std::function<bool()>& done,
                     absl::Time deadline);

// Reservations this thread holds through each gate (SameHostTransport).
thread_local std::vector<std::pair<const ReadGate*, int>> t_reserved;

int& reserved_here(const ReadGate* gate) {
  for (auto& [g, n] : t_reserved) {
    if (g == gate) return n;
  }
  t_reserved.emplace_back(gate, 0);
  return t_reserved.back().second;
}

// For the scope of a wait on one kind of channel: gives this thread's
// reservations of the other kind back, and takes them again at the end.
class Lend {
 public:
  Lend(ReadGate* gate, bool same_host_side) : gate_(gate), same_host_side_(same_host_side) {
    n_ = reserved_here(gate);
    for (int i = 0; i < n_; ++i) release();
  }
  ~Lend() {
    for (int i = 0; i < n_; ++i) reserve();
  }
  Lend(const Lend&) = delete;
  Lend& operator=(const Lend&) = delete;

 private:
  void release() {
    if (same_host_side_) {
      absl::MutexLock lock(&gate_->mu);
      --gate_->reserved;
    } else {
      gate_->fallback->release_reading();
    }
  }
  void reserve() {
    if (same_host_side_) {
      absl::MutexLock lock(&gate_->mu);
      ++gate_->reserved;
    } else {
      gate_->fallback->reserve_reading();
    }
  }
  ReadGate* const gate_;
  const bool same_host_side_;  // lends the same-host reservations (a gRPC wait)
  int n_ = 0;
};

class SameHostChannel : public Channel, public std::enable_shared_from_this<SameHostChannel> {
 public:
  // Null if the server's socket cannot be reached.
  static std::shared_ptr<SameHostChannel> open(const std::shared_ptr<ReadGate>& gate,
                                               const std::string& name,
                                               const PeerOptions& options, OnFrame on_frame,
                                               OnClose on_close) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return nullptr;
    sockaddr_un addr;
    socklen_t len;
    set_abstract_address(name, &addr, &len);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      ::close(fd);
      return nullptr;
    }
    uid_t uid;
    const pid_t pid = peer_pid_of(fd, &uid);
    auto ch = std::shared_ptr<SameHostChannel>(new SameHostChannel(
        gate,
        std::make_unique<Conn>(fd, pid, options.max_message_bytes, options.keepalive_interval,
                               options.keepalive_timeout),
        std::move(on_frame), std::move(on_close)));
    HelloBody hello;
    hello.worker = options.self;
    const std::string proof = options.security.authenticated()
                                  ? internal::auth_proof(options.security.token,
                                                         {"rpc", "same-host", options.self, options.peer})
                                  : std::string();
    hello.proof_size = static_cast<uint32_t>(proof.size());
    hello.probe = reinterpret_cast<uint64_t>(kProbe);
    std::string body(sizeof(hello), '\0');
    std::memcpy(body.data(), &hello, sizeof(hello));
    body += proof;
    ch->conn_->send_control(kHello, 0, 0, body);
    {
      absl::MutexLock lock(&gate->mu);
      gate->channels.push_back(ch);
    }
    std::thread([ch, batch = gate->settings->options.batch_scheduling] {
      rpc::internal::apply_thread_policy(batch);
      ch->background_loop();
    }).detach();
    return ch;
  }

  ~SameHostChannel() override = default;

  bool send(Frame frame, const SendOptions& options) override {
    {
      absl::MutexLock lock(&gate_->mu);
      if (ended_ || closing_) return false;
      if (options.expects_reply) ++expecting_;
    }
    frame.more_in_flight = options.more_in_flight;
    return conn_->send_frame(frame);
  }

  bool broken() const override {
    absl::MutexLock lock(&gate_->mu);
    return ended_;
  }
  void drive(const std::function<bool()>& done, absl::Time deadline) override {
    drive_same_host(gate_, done, deadline);
  }

  // Reads what has come (a goodbye, the end of the connection) and looks at
  // the peer's process when no thread reads: an idle channel learns of its
  // peer's end, or that it has stopped, here.
  void check_connection() override {
    if (!try_take_role()) return;
    absl::Status ok = absl::OkStatus();
    while (ok.ok()) {
      pollfd q{conn_->fd(), POLLIN, 0};
      if (!conn_->has_buffered() && poll(&q, 1, 0) <= 0) break;
      ok = read_one();
    }
    if (ok.ok()) ok = conn_->check_peer_now_and_then();
    release_role();
    if (!ok.ok()) end(failed(ok));
  }

  void close(bool graceful) override {
    const std::thread::id me = std::this_thread::get_id();
    {
      absl::MutexLock lock(&gate_->mu);
      if (!closing_) {
        closing_ = true;
      } else {
        // Closed already: wait for the first close's end.
        auto over = [this, me]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) {
          return close_done_ || background_id_ == me;
        };
        gate_->mu.Await(absl::Condition(&over));
        return;
      }
    }
    conn_->send_control(kGoodbye, 0, 0);
    if (graceful) {
      conn_->shutdown_after_flush(absl::Seconds(5));
    } else {
      conn_->shutdown();
    }
    {
      // No thread but this one reads any more, and the background thread
      // has gone (unless this is it).
      absl::MutexLock lock(&gate_->mu);
      auto quiet = [this, me]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) {
        return (holder_ == std::thread::id() || holder_ == me) &&
               (background_done_ || background_id_ == me);
      };
      gate_->mu.Await(absl::Condition(&quiet));
    }
    end(CloseReason{});
    absl::MutexLock lock(&gate_->mu);
    close_done_ = true;
  }

  // ---- for SameHostTransport::drive (gate_->mu held)

  // Takes the role if free; returns whether this thread now holds it
  // (already held by this thread counts, `nested` then set).
  bool claim_for_driver(std::thread::id me, bool* nested) ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) {
    *nested = false;
    if (ended_ || closing_ || !welcomed_) return false;
    if (holder_ == me) {
      *nested = true;
      return true;
    }
    if (holder_ != std::thread::id()) return false;
    holder_ = me;
    return true;
  }
  void release_for_driver() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) {
    holder_ = std::thread::id();
    ++gate_->version;
  }
  // Ended, or being closed: a driver lets it go.
  bool over() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) { return ended_ || closing_; }
  bool held_by_other(std::thread::id me) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) {
    return !ended_ && ((holder_ != std::thread::id() && holder_ != me) || !welcomed_);
  }
  Conn* conn() { return conn_.get(); }

  // Reads and handles one message (the caller holds the role); an error
  // ends the channel.
  void read_one_or_end() {
    absl::Status ok = read_one();
    if (!ok.ok()) end(failed(ok));
  }
  void check_peer_or_end() {
    absl::Status ok = conn_->check_peer_now_and_then();
    if (!ok.ok()) end(failed(ok));
  }

 private:
  SameHostChannel(std::shared_ptr<ReadGate> gate, std::unique_ptr<Conn> conn, OnFrame on_frame,
                  OnClose on_close)
      : gate_(std::move(gate)),
        conn_(std::move(conn)),
        on_frame_(std::move(on_frame)),
        on_close_(std::move(on_close)) {}

  static CloseReason failed(const absl::Status& why) {
    CloseReason r;
    r.ok = false;
    r.unreachable = absl::IsUnavailable(why) || absl::IsDeadlineExceeded(why);
    r.message = std::string(why.message());
    return r;
  }

  bool try_take_role() {
    absl::MutexLock lock(&gate_->mu);
    if (ended_ || !welcomed_ || holder_ != std::thread::id()) return false;
    holder_ = std::this_thread::get_id();
    return true;
  }
  void release_role() {
    absl::MutexLock lock(&gate_->mu);
    holder_ = std::thread::id();
    ++gate_->version;
  }

  // Ends the channel once: the socket closes and OnClose runs.
  void end(const CloseReason& reason) {
    {
      absl::MutexLock lock(&gate_->mu);
      if (ended_) return;
      ended_ = true;
      ++gate_->version;
      gate_->wake_drivers();
    }
    conn_->shutdown();
    try {
      on_close_(closing_now() ? CloseReason{} : reason);
    } catch (...) {
      LOG(ERROR) << "rpc same-host transport: a close callback threw";
    }
  }
  bool closing_now() {
    absl::MutexLock lock(&gate_->mu);
    return closing_;
  }

  // Reads while replies are expected and nobody else reads.
  void background_loop() {
    {
      absl::MutexLock lock(&gate_->mu);
      background_id_ = std::this_thread::get_id();
    }
    absl::Status ok = welcome();
    if (ok.ok()) conn_->start_reading_ahead();
    {
      absl::MutexLock lock(&gate_->mu);
      welcomed_ = true;  // drivers may read from here on
      ++gate_->version;
    }
    if (!ok.ok()) end(failed(ok));
    const std::thread::id me = std::this_thread::get_id();
    for (;;) {
      {
        absl::MutexLock lock(&gate_->mu);
        auto my_turn = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) {
          return ended_ || closing_ ||
                 (holder_ == std::thread::id() && expecting_ > 0 && gate_->reserved == 0);
        };
        gate_->mu.Await(absl::Condition(&my_turn));
        if (ended_ || closing_) break;
        holder_ = me;
      }
      ok = conn_->wait_readable(absl::InfiniteFuture(), [this] {
        absl::MutexLock lock(&gate_->mu);
        return expecting_ == 0 || gate_->reserved > 0;
      });
      if (ok.ok()) ok = read_one();
      release_role();
      if (!ok.ok() && !absl::IsAborted(ok)) {
        end(failed(ok));
        break;
      }
    }
    absl::MutexLock lock(&gate_->mu);
    background_done_ = true;
  }

  // One message: a reply, an acknowledgement or a goodbye. Never throws.
  absl::Status read_one() {
    try {
      return read_one_unguarded();
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("rpc transport: ", e.what()));
    }
  }
  absl::Status read_one_unguarded() {
    Preamble p;
    absl::Status ok = read_preamble(conn_.get(), &p, nullptr);
    if (!ok.ok()) return ok;
    if (p.kind == kFrame) {
      internal::fault_point("transport.client_read");
      Frame frame;
      ok = conn_->read_frame(p, &frame);
      if (!ok.ok()) return ok;
      capture(*gate_->settings, "reply", frame);
      if (p.num_remote > 0) conn_->send_control(kAck, 0, p.seq);
      try {
        ok = on_frame_(std::move(frame));
      } catch (const std::exception& e) {
        ok = absl::InternalError(e.what());
      }
      {
        absl::MutexLock lock(&gate_->mu);
        if (expecting_ > 0) --expecting_;
        ++gate_->version;
        gate_->wake_drivers();
      }
      // A gRPC reader may wait for what this reply completed.
      gate_->fallback->interrupt_drive();
      return ok;
    }
    if (p.kind == kAck && p.body == 0) return conn_->on_ack(p.seq);
    if (p.kind == kGoodbye && p.body == 0) {
      end(CloseReason{});
      return absl::OkStatus();
    }
    if (p.kind == kGoodbye && p.body <= kMaxHandshakeBody) {
      // The server ended the connection over an error, which it names.
      std::string why(p.body, '\0');
      ok = conn_->read_exact(why.data(), why.size());
      if (!ok.ok()) return ok;
      return absl::InternalError(why);
    }
    return absl::DataLossError(absl::StrCat("unexpected message kind ", int{p.kind}));
  }

  absl::Status welcome() {
    const absl::Time deadline = absl::Now() + kHandshakeTimeout;
    Preamble p;
    absl::Status ok = read_preamble(conn_.get(), &p, nullptr, deadline);
    if (!ok.ok()) return ok;
    if (p.kind != kWelcome || p.body < sizeof(WelcomeBody) || p.body > kMaxHandshakeBody) {
      return absl::DataLossError("the server did not answer the hello");
    }
    std::string body(p.body, '\0');
    ok = conn_->read_exact(body.data(), body.size(), nullptr, deadline);
    if (!ok.ok()) return ok;
    WelcomeBody w;
    std::memcpy(&w, body.data(), sizeof(w));
    if (w.message_size != body.size() - sizeof(w)) return absl::DataLossError("a malformed welcome");
    if (w.code != 0) {
      return absl::Status(static_cast<absl::StatusCode>(w.code),
                          absl::StrCat("the worker refused the connection: ",
                                       body.substr(sizeof(w))));
    }
    conn_->set_may_send_remote(w.cross_memory != 0);
    const bool can_read = can_read_remote(conn_->peer_pid(), w.probe);
    conn_->send_control(kConfirm, can_read ? kFlagCrossMemory : 0, 0);
    return absl::OkStatus();
  }

  const std::shared_ptr<ReadGate> gate_;
  const std::unique_ptr<Conn> conn_;
  const OnFrame on_frame_;
  const OnClose on_close_;

  // State below is protected by gate_->mu.
  bool ended_ ABSL_GUARDED_BY(gate_->mu) = false;
  bool closing_ ABSL_GUARDED_BY(gate_->mu) = false;
  bool close_done_ ABSL_GUARDED_BY(gate_->mu) = false;
  bool welcomed_ ABSL_GUARDED_BY(gate_->mu) = false;  // the handshake is over
  bool background_done_ ABSL_GUARDED_BY(gate_->mu) = false;
  int64_t expecting_ ABSL_GUARDED_BY(gate_->mu) = 0;  // replies not yet read
  std::thread::id holder_ ABSL_GUARDED_BY(gate_->mu);  // of the reading role
  std::thread::id background_id_ ABSL_GUARDED_BY(gate_->mu);
};

// How deep in drive_same_host this thread is.
thread_local int t_driving = 0;

// Registers this thread's eventfd with the gate for the scope.
class DriverRegistration {
 public:
  explicit DriverRegistration(ReadGate* gate) : gate_(gate) {
    if (t_driver_fd < 0) t_driver_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (t_driving++ > 0) return;
    absl::MutexLock lock(&gate_->mu);
    gate_->driver_fds.push_back(t_driver_fd);
  }
  ~DriverRegistration() {
    if (--t_driving > 0) return;
    absl::MutexLock lock(&gate_->mu);
    auto& fds = gate_->driver_fds;
    auto it = std::find(fds.begin(), fds.end(), t_driver_fd);
    if (it != fds.end()) fds.erase(it);
  }
  DriverRegistration(const DriverRegistration&) = delete;
  DriverRegistration& operator=(const DriverRegistration&) = delete;

 private:
  ReadGate* const gate_;
};

// One wait of a driver on the channels whose reading role it holds (and
// its wake-up fd): reads what came, or checks the peers when nothing did.
void poll_and_read(const ReadGate& gate,
                   const std::vector<std::shared_ptr<SameHostChannel>>& reading,
                   absl::Duration wait) {
  std::vector<pollfd> fds;
  fds.reserve(1 + 2 * reading.size());
  fds.push_back({t_driver_fd, POLLIN, 0});  // a reply handled elsewhere
  for (auto& ch : reading) {
    const bool out = ch->conn()->flush();
    fds.push_back({ch->conn()->fd(), static_cast<short>(POLLIN | (out ? POLLOUT : 0)), 0});
    fds.push_back({ch->conn()->wake_fd(), POLLIN, 0});
  }
  const int r = SpinPoll::this_thread(gate.settings->spin_ns.load(std::memory_order_relaxed))
                    .poll(fds.data(), fds.size(),
                          static_cast<int>(absl::ToInt64Milliseconds(wait) + 1));
  if (r > 0 && (fds[0].revents & POLLIN)) {
    uint64_t v;
    ssize_t ignored = ::read(t_driver_fd, &v, sizeof(v));
    (void)ignored;
  }
  for (size_t i = 0; i < reading.size() && r > 0; ++i) {
    if (fds[2 + 2 * i].revents & POLLIN) reading[i]->conn()->drain_wake();
    if (fds[1 + 2 * i].revents & (POLLIN | POLLHUP | POLLERR)) reading[i]->read_one_or_end();
  }
  if (r == 0) {
    for (auto& ch : reading) ch->check_peer_or_end();
  }
}

void drive_same_host(const std::shared_ptr<ReadGate>& gate_, const std::function<bool()>& done,
                     absl::Time deadline) {
  Lend lend(gate_.get(), /*same_host_side=*/false);
  DriverRegistration registered(gate_.get());
  // Slices bound how long a completion from elsewhere (a timeout, a
  // reply read by another thread) goes unnoticed.
  constexpr absl::Duration kSlice = absl::Milliseconds(50);
  const std::thread::id me = std::this_thread::get_id();
  // The roles this thread holds, kept until it returns: letting them go
  // between its waits would wake the channels' background readers to take
  // them, only for this thread to wait for them back.
  std::vector<std::shared_ptr<SameHostChannel>> reading;
  std::vector<bool> nested;
  auto release = [&] {
    absl::MutexLock lock(&gate_->mu);
    for (size_t i = 0; i < reading.size(); ++i) {
      if (!nested[i]) reading[i]->release_for_driver();
    }
  };
  while (!done()) {
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    bool others = false;
    {
      absl::MutexLock lock(&gate_->mu);
      // Ended or closing channels are let go (close() waits for that).
      for (size_t i = 0; i < reading.size();) {
        if (!reading[i]->over()) {
          ++i;
          continue;
        }
        if (!nested[i]) reading[i]->release_for_driver();
        reading.erase(reading.begin() + i);
        nested.erase(nested.begin() + i);
      }
      auto& list = gate_->channels;
      for (size_t i = 0; i < list.size();) {
        std::shared_ptr<SameHostChannel> ch = list[i].lock();
        if (!ch) {
          list[i] = list.back();
          list.pop_back();
          continue;
        }
        ++i;
        if (std::find(reading.begin(), reading.end(), ch) != reading.end()) continue;
        bool is_nested;
        if (ch->claim_for_driver(me, &is_nested)) {
          reading.push_back(std::move(ch));
          nested.push_back(is_nested);
        } else if (ch->held_by_other(me)) {
          others = true;
        }
      }
      if (reading.empty() && others) {
        // Another thread reads: wait until it lets a role go or a reply
        // is handled (a slice at most), then look at done() again.
        const uint64_t seen = gate_->version;
        auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) {
          return gate_->version != seen;
        };
        gate_->mu.AwaitWithTimeout(absl::Condition(&changed), std::min(kSlice, deadline - now));
      }
    }
    if (reading.empty()) {
      if (!others) break;  // no same-host channel to read
      continue;
    }
    // Messages read ahead first: polling the socket would not show them.
    bool read_ahead = false;
    for (auto& ch : reading) {
      if (!ch->conn()->has_buffered()) continue;
      read_ahead = true;
      ch->read_one_or_end();
    }
    if (!read_ahead) poll_and_read(*gate_, reading, std::min(kSlice, deadline - now));
  }
  release();
}


// ------------------------------------------------------------ the pair

class PairServer : public Server {
 public:
  PairServer(std::unique_ptr<Server> fallback, std::shared_ptr<SameHostServer> local)
      : fallback_(std::move(fallback)), local_(std::move(local)) {}
  ~PairServer() override {
    if (local_) local_->shutdown(absl::ZeroDuration());
  }
  int port() const override { return fallback_->port(); }
  std::string same_host_endpoint() const override {
    return local_ ? absl::StrCat(host_identity(), "|", local_->name()) : std::string();
  }
  void shutdown(absl::Duration grace) override {
    if (local_) local_->shutdown(grace);
    fallback_->shutdown(grace);
  }

 private:
  const std::unique_ptr<Server> fallback_;
  const std::shared_ptr<SameHostServer> local_;
};

// A channel of the wrapped transport; waits on it lend this thread's
// same-host reservations back (see ReadGate).
class FallbackChannel : public Channel {
 public:
  FallbackChannel(std::shared_ptr<ReadGate> gate, std::shared_ptr<Channel> inner)
      : gate_(std::move(gate)), inner_(std::move(inner)) {}
  bool send(Frame frame, const SendOptions& options) override {
    return inner_->send(std::move(frame), options);
  }
  bool broken() const override { return inner_->broken(); }
  void drive(const std::function<bool()>& done, absl::Time deadline) override {
    Lend lend(gate_.get(), /*same_host_side=*/true);
    inner_->drive(done, deadline);
  }
  void check_connection() override { inner_->check_connection(); }
  void close(bool graceful) override { inner_->close(graceful); }
  Channel* inner() const { return inner_.get(); }

 private:
  const std::shared_ptr<ReadGate> gate_;
  const std::shared_ptr<Channel> inner_;
};

class SameHostTransport : public Transport {
 public:
  SameHostTransport(std::shared_ptr<Transport> fallback, const TransportOptions& options)
      : fallback_(std::move(fallback)),
        settings_(std::make_shared<Settings>(options)),
        gate_(std::make_shared<ReadGate>()) {
    gate_->fallback = fallback_.get();
    gate_->settings = settings_;
  }

  std::unique_ptr<Server> listen(const std::string& host, const ServerLimits& limits,
                                 const Security& security, CheckRequest check,
                                 OnRequest run_inline, OnRequest offload) override {
    std::unique_ptr<Server> fallback =
        fallback_->listen(host, limits, security, check, run_inline, offload);
    return std::make_unique<PairServer>(
        std::move(fallback),
        SameHostServer::start(limits, security, std::move(check), std::move(run_inline),
                              std::move(offload), settings_));
  }

  std::shared_ptr<Channel> connect(const std::string& address, const PeerOptions& options,
                                   Channel::OnFrame on_frame, Channel::OnClose on_close) override {
    const std::string& endpoint = options.same_host_endpoint;
    const size_t bar = endpoint.rfind('|');
    if (bar != std::string::npos && endpoint.substr(0, bar) == host_identity()) {
      std::shared_ptr<Channel> ch = SameHostChannel::open(gate_, endpoint.substr(bar + 1),
                                                          options, on_frame, on_close);
      if (ch) return ch;
      LOG(WARNING) << "rpc: cannot reach the same-host endpoint of " << address
                   << "; connecting over the network";
    }
    // Its replies wake same-host readers too: one may wait for what a reply
    // completed.
    Channel::OnFrame wrapped = [gate = gate_, on_frame = std::move(on_frame)](Frame frame) {
      absl::Status ok = on_frame(std::move(frame));
      absl::MutexLock lock(&gate->mu);
      ++gate->version;
      gate->wake_drivers();
      return ok;
    };
    return std::make_shared<FallbackChannel>(
        gate_, fallback_->connect(address, options, std::move(wrapped), std::move(on_close)));
  }

  void reserve_reading() override {
    fallback_->reserve_reading();
    ++reserved_here(gate_.get());
    absl::MutexLock lock(&gate_->mu);
    ++gate_->reserved;
  }
  void release_reading() override {
    fallback_->release_reading();
    --reserved_here(gate_.get());
    absl::MutexLock lock(&gate_->mu);
    --gate_->reserved;
  }

  void drive(const std::function<bool()>& done, absl::Time deadline) override {
    drive_same_host(gate_, done, deadline);
  }

  bool probe(const std::string& address, const PeerOptions& options,
             absl::Time deadline) override {
    return fallback_->probe(address, options, deadline);
  }

  // Waits spin before they sleep only while the job's processes on this
  // host fit its CPUs: with more, a spinning thread takes the CPU a peer
  // needs to answer.
  void world_known(const std::vector<std::string>& same_host_endpoints) override {
    fallback_->world_known(same_host_endpoints);
    int here = 0;
    for (const std::string& endpoint : same_host_endpoints) {
      const size_t bar = endpoint.rfind('|');
      if (bar != std::string::npos && endpoint.substr(0, bar) == host_identity()) ++here;
    }
    settings_->spin_ns.store(
        here >= 2 && here <= usable_cpus() ? spin_ns(settings_->options.max_spin) : 0,
        std::memory_order_relaxed);
  }

 private:
  const std::shared_ptr<Transport> fallback_;
  const std::shared_ptr<Settings> settings_;
  const std::shared_ptr<ReadGate> gate_;
};

}  // namespace

const std::string& host_identity() {
  static const std::string id = absl::StrCat(
      read_small_file("/proc/sys/kernel/random/boot_id"), "/", link_target("/proc/self/ns/net"),
      "/", link_target("/proc/self/ns/pid"));
  return id;
}


std::shared_ptr<Transport> make_same_host_transport(std::shared_ptr<Transport> fallback,
                                                    const TransportOptions& options) {
  return std::make_shared<SameHostTransport>(std::move(fallback), options);
}

}  // namespace ddprpc::rpc::transport
