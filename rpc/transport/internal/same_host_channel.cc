#include "rpc/transport/internal/same_host_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "rpc/core/internal/auth.h"
#include "rpc/core/internal/fault.h"
#include "rpc/core/internal/thread_policy.h"
#include "rpc/transport/internal/same_host_process.h"
#include "rpc/transport/internal/same_host_protocol.h"

namespace ddprpc::rpc::transport::same_host {

std::shared_ptr<SameHostChannel> SameHostChannel::open(const std::shared_ptr<ReadGate>& gate,
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
  // Request tensors lent to the callee by address stay held until it
  // acknowledges them: past this many bytes unacknowledged they go inline,
  // so that a callee that never acknowledges cannot make this process hold
  // everything it sends.
  constexpr int64_t kMaxLentRequestBytes = int64_t{1} << 30;
  auto ch = std::shared_ptr<SameHostChannel>(new SameHostChannel(
      gate,
      std::make_unique<Conn>(fd, pid, options.max_message_bytes, options.keepalive_interval,
                             options.keepalive_timeout, nullptr, kMaxLentRequestBytes),
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

bool SameHostChannel::send(Frame frame, const SendOptions& options) {
  {
    absl::MutexLock lock(&gate_->mu);
    if (ended_ || closing_ || close_by_ != absl::InfiniteFuture()) return false;
    if (options.expects_reply) ++expecting_;
  }
  frame.more_in_flight = options.more_in_flight;
  return conn_->send_frame(frame);
}

void SameHostChannel::check_connection() {
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

void SameHostChannel::begin_close() {
  absl::MutexLock lock(&gate_->mu);
  if (!closing_ && close_by_ == absl::InfiniteFuture()) {
    close_by_ = absl::Now() + kGracefulCloseWait;
  }
}

void SameHostChannel::close(bool graceful) {
  const std::thread::id me = std::this_thread::get_id();
  absl::Duration flush_for = kGracefulCloseWait;
  {
    absl::MutexLock lock(&gate_->mu);
    if (!closing_) {
      closing_ = true;
      if (close_by_ != absl::InfiniteFuture()) {
        flush_for = std::max(absl::ZeroDuration(), close_by_ - absl::Now());
      }
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
    conn_->shutdown_after_flush(flush_for);
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

bool SameHostChannel::claim_for_driver(std::thread::id me, bool* nested) {
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

CloseReason SameHostChannel::failed(const absl::Status& why) {
  CloseReason r;
  r.ok = false;
  r.unreachable = absl::IsUnavailable(why) || absl::IsDeadlineExceeded(why);
  r.message = std::string(why.message());
  return r;
}

bool SameHostChannel::try_take_role() {
  absl::MutexLock lock(&gate_->mu);
  if (ended_ || !welcomed_ || holder_ != std::thread::id()) return false;
  holder_ = std::this_thread::get_id();
  return true;
}

void SameHostChannel::end(const CloseReason& reason) {
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

void SameHostChannel::background_loop() {
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

absl::Status SameHostChannel::read_one() {
  try {
    return read_one_unguarded();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("rpc transport: ", e.what()));
  }
}

absl::Status SameHostChannel::read_one_unguarded() {
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
    ok = conn_->read_exact(why.data(), why.size(), nullptr, absl::InfiniteFuture(),
                           /*in_message=*/true);
    if (!ok.ok()) return ok;
    return absl::InternalError(why);
  }
  return absl::DataLossError(absl::StrCat("unexpected message kind ", int{p.kind}));
}

absl::Status SameHostChannel::welcome() {
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

}  // namespace ddprpc::rpc::transport::same_host
