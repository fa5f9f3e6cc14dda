#include "rpc/transport/internal/same_host_connection.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "rpc/transport/internal/cross_memory.h"
#include "rpc/transport/internal/frame_capture.h"
#include "rpc/transport/internal/same_host_process.h"
#include "rpc/transport/same_host_transport.h"

namespace ddprpc::rpc::transport::same_host {

Conn::Conn(int fd, pid_t peer_pid, int64_t max_message_bytes, absl::Duration keepalive_interval,
           absl::Duration keepalive_timeout, std::function<void()> on_wake,
           int64_t max_lent_bytes)
    : fd_(fd),
      wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
      peer_pid_(peer_pid),
      max_message_bytes_(max_message_bytes),
      max_lent_bytes_(max_lent_bytes),
      keepalive_interval_(std::max(keepalive_interval, absl::Milliseconds(10))),
      keepalive_timeout_(keepalive_timeout),
      on_wake_(std::move(on_wake)) {}

Conn::~Conn() {
  ::close(fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Conn::drain_wake() {
  uint64_t v;
  ssize_t ignored = ::read(wake_fd_, &v, sizeof(v));
  (void)ignored;
}

void capture(const Settings& settings, const char* kind, const Frame& frame) {
  if (settings.options.capture_frames_dir.empty()) return;
  rpc::internal::capture_frame(settings.options.capture_frames_dir, kind,
                               rpc::internal::serialize_frame(frame));
}

bool Conn::send_frame(const Frame& frame) {
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

bool Conn::send_control(Kind kind, uint8_t flags, uint64_t seq, const std::string& body) {
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

absl::Status Conn::on_ack(uint64_t seq) {
  absl::MutexLock lock(&write_mu_);
  auto it = unacked_.find(seq);
  if (it == unacked_.end()) {
    return absl::DataLossError(absl::StrCat("acknowledgement of unknown frame ", seq));
  }
  unacked_bytes_ -= it->second.second;
  unacked_.erase(it);
  return absl::OkStatus();
}

void Conn::shutdown() {
  {
    absl::MutexLock lock(&write_mu_);
    shut_ = true;
    out_.clear();
    queued_bytes_ = 0;
  }
  ::shutdown(fd_, SHUT_RDWR);
  wake();
}

void Conn::shutdown_after_flush(absl::Duration timeout) {
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

void Conn::wake() {
  if (on_wake_) on_wake_();
  if (wake_fd_ < 0) return;
  uint64_t one = 1;
  ssize_t ignored = ::write(wake_fd_, &one, sizeof(one));
  (void)ignored;
}

absl::Status Conn::wait_readable(absl::Time deadline,
                                 const std::function<bool()>& yield) {
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

absl::Status Conn::flush_for_reader(bool* want_out) {
  absl::MutexLock lock(&write_mu_);
  flush_locked();
  *want_out = !out_.empty();
  if (shut_) return absl::CancelledError("the connection was closed");
  if (broken_) return absl::UnavailableError(broken_why_);
  return absl::OkStatus();
}

absl::Status Conn::fill(bool* would_block, bool* eof) {
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

absl::Status Conn::check_peer_now_and_then() {
  const absl::Time now = absl::Now();
  if (now - last_check_ < keepalive_interval_ / 2) return absl::OkStatus();
  last_check_ = now;
  return check_peer();
}

absl::Status Conn::read_exact(void* dst, size_t n, bool* eof, absl::Time deadline,
                              bool in_message) {
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
    // The bytes of a message that has started come without a long pause
    // (measured from the last that came): a live peer that stops part way
    // ends the connection instead of holding its reader (a stopped or dead
    // one is found sooner, by check_peer). The pause allowed is long: a
    // live sender's queued bytes may wait for its own reader's turn to
    // write them.
    const absl::Duration silence = 6 * keepalive_timeout_;
    const absl::Time until =
        in_message || done > 0 ? std::min(deadline, absl::Now() + silence) : deadline;
    absl::Status ready = wait_readable(until);
    if (absl::IsDeadlineExceeded(ready) && until < deadline) {
      return absl::UnavailableError(absl::StrCat(
          "the peer sent part of a message, then nothing for ", absl::FormatDuration(silence)));
    }
    if (absl::IsDeadlineExceeded(ready) && in_message) {
      return absl::UnavailableError(
          "the peer sent a message too slowly (past the pause limit plus its bytes at 16 MiB/s)");
    }
    if (!ready.ok()) return ready;
  }
  return absl::OkStatus();
}

absl::Status Conn::read_growing(size_t n, std::string* out, absl::Time deadline) {
  out->clear();
  out->reserve(n);
  constexpr size_t kStep = size_t{1} << 20;
  while (out->size() < n) {
    const size_t at = out->size();
    const size_t take = std::min(kStep, n - at);
    out->resize(at + take);
    absl::Status ok = read_exact(out->data() + at, take, nullptr, deadline, /*in_message=*/true);
    if (!ok.ok()) return ok;
  }
  return absl::OkStatus();
}

absl::Status Conn::read_frame(const Preamble& p, Frame* frame) {
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
  // However its bytes are spread, a message comes within the pause limit
  // plus its bytes at 16 MiB/s: a peer that sends a byte a pause cannot
  // hold this reader, the receive budget its claim took and the tensors it
  // named for longer.
  const absl::Time deadline =
      absl::Now() + 6 * keepalive_timeout_ +
      absl::Seconds(static_cast<double>(p.body + p.inline_bytes) / kMinMessageBytesPerSecond);
  std::string head;
  absl::Status ok = read_growing(p.body, &head, deadline);
  if (!ok.ok()) return ok;
  std::vector<RemoteTensor> remote(p.num_remote);
  if (p.num_remote > 0) {
    ok = read_exact(remote.data(), remote.size() * sizeof(RemoteTensor), nullptr, deadline,
                    /*in_message=*/true);
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
        return read_exact(dst, n, nullptr, deadline, /*in_message=*/true);
      },
      frame);
  if (!ok.ok()) return ok;
  if (next_remote != remote.size() || remote_read != p.remote_bytes ||
      inline_read != p.inline_bytes) {
    return absl::DataLossError("a frame's tensors do not match its remote and inline bytes");
  }
  return absl::OkStatus();
}

void Conn::enqueue(std::string bytes, at::Tensor tensor) {
  Piece piece;
  piece.bytes = std::move(bytes);
  piece.tensor = std::move(tensor);
  queued_bytes_ += piece.size();
  out_.push_back(std::move(piece));
}

void Conn::flush_locked() {
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

absl::Status Conn::check_peer() {
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

absl::Status read_preamble(Conn* conn, Preamble* p, bool* eof,
                           absl::Time deadline) {
  absl::Status ok = conn->read_exact(p, sizeof(*p), eof, deadline);
  if (!ok.ok()) return ok;
  if (p->magic != kMagic) return absl::DataLossError("a message without the protocol's magic");
  return absl::OkStatus();
}

}  // namespace ddprpc::rpc::transport::same_host
