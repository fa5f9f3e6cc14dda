#include "rpc/transport/internal/bulk_lender.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "rpc/transport/internal/bulk_wire.h"

namespace ddprpc::rpc::transport::bulk {

absl::StatusOr<const char*> lent_data(const c10::Storage& storage, uint64_t first,
                                      uint64_t nbytes) {
  if (storage.nbytes() < first + nbytes) {
    return absl::FailedPreconditionError("the storage of the lent tensor shrank");
  }
  return static_cast<const char*>(storage.data()) + first;
}

uint64_t LendTable::lend(int peer, uint64_t frame_id, const at::Tensor& tensor, bool reply,
                         absl::Time not_before, uint64_t channel) {
  const uint64_t nbytes = tensor.numel() * tensor.element_size();
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  expire_locked(now);
  int64_t& held = bytes_[{peer, reply}];
  if (held + static_cast<int64_t>(nbytes) > max_bytes_[reply ? 1 : 0]) return 0;
  held += static_cast<int64_t>(nbytes);
  const uint64_t id = next_id_++;
  const absl::Time expires = std::max(now + timeout_, not_before);
  // The storage too: the program may point its tensor elsewhere (set_,
  // .data =) while the lend lasts; the bytes lent stay those it lent, and
  // they stay allocated.
  const uint64_t begin = static_cast<uint64_t>(tensor.storage_offset()) * tensor.element_size();
  lends_.emplace(std::make_pair(peer, id), Lend{tensor, tensor.storage(), begin, nbytes, frame_id,
                                                reply, expires, channel});
  if (!reply) request_lends_.fetch_add(1);
  by_time_.emplace(expires, std::make_pair(peer, id));
  return id;
}

absl::StatusOr<LendTable::LentBytes> LendTable::find(int peer, uint64_t id, uint64_t offset,
                                                     uint64_t length) {
  absl::MutexLock lock(&mu_);
  expire_locked(absl::Now());
  auto it = lends_.find({peer, id});
  if (it == lends_.end()) {
    return absl::NotFoundError(absl::StrCat("no lend ", id, " to worker ", peer));
  }
  uint64_t end;
  if (__builtin_add_overflow(offset, length, &end) || end > it->second.nbytes) {
    return absl::OutOfRangeError(absl::StrCat("bytes [", offset, ", +", length, ") of lend ", id,
                                              " of ", it->second.nbytes, " bytes"));
  }
  const Lend& lend = it->second;
  absl::StatusOr<const char*> data = lent_data(lend.storage, lend.begin, lend.nbytes);
  if (!data.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("lend ", id, ": ", data.status().message()));
  }
  return LentBytes{lend.tensor, lend.storage, *data};
}

void LendTable::release(int peer, uint64_t id) {
  absl::MutexLock lock(&mu_);
  erase_locked(peer, id);
}

void LendTable::release_request(int peer, uint64_t frame_id) {
  if (request_lends_.load() == 0) return;
  absl::MutexLock lock(&mu_);
  for (auto it = lends_.lower_bound({peer, 0}); it != lends_.end() && it->first.first == peer;) {
    const uint64_t id = it->first.second;
    const bool match = !it->second.reply && it->second.frame_id == frame_id;
    ++it;
    if (match) erase_locked(peer, id);
  }
}

void LendTable::release_channel(int peer, uint64_t channel) {
  if (request_lends_.load() == 0 || channel == 0) return;
  absl::MutexLock lock(&mu_);
  for (auto it = lends_.lower_bound({peer, 0}); it != lends_.end() && it->first.first == peer;) {
    const uint64_t id = it->first.second;
    const bool match = !it->second.reply && it->second.channel == channel;
    ++it;
    if (match) erase_locked(peer, id);
  }
}

void LendTable::expire() {
  absl::MutexLock lock(&mu_);
  expire_locked(absl::Now());
}

int64_t LendTable::lent_bytes(int peer) {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (bool reply : {false, true}) {
    auto it = bytes_.find({peer, reply});
    if (it != bytes_.end()) n += it->second;
  }
  return n;
}

size_t LendTable::size() {
  absl::MutexLock lock(&mu_);
  return lends_.size();
}

void LendTable::expire_locked(absl::Time now) {
  while (!by_time_.empty() && by_time_.begin()->first <= now) {
    const auto key = by_time_.begin()->second;
    by_time_.erase(by_time_.begin());
    erase_locked(key.first, key.second);
  }
}

void LendTable::erase_locked(int peer, uint64_t id) {
  auto it = lends_.find({peer, id});
  if (it == lends_.end()) return;
  bytes_[{peer, it->second.reply}] -= static_cast<int64_t>(it->second.nbytes);
  if (!it->second.reply) request_lends_.fetch_sub(1);
  by_time_.erase({it->second.expires, {peer, id}});
  lends_.erase(it);
}

// ---------------------------------------------------------------------------

std::unique_ptr<Listener> Listener::start(const std::string& host, const ListenerLimits& limits,
                                          std::shared_ptr<LendTable> table,
                                          std::shared_ptr<ClaimTable> claims, std::string* error) {
  int port = 0;
  const int fd = listen_on(host, &port, error);
  if (fd < 0) return nullptr;
  const int wake = ::eventfd(0, EFD_CLOEXEC);
  if (wake < 0) {
    *error = absl::StrCat("eventfd: ", strerror(errno));
    ::close(fd);
    return nullptr;
  }
  return std::unique_ptr<Listener>(
      new Listener(fd, wake, port, limits, std::move(table), std::move(claims)));
}

Listener::Listener(int fd, int wake_fd, int port, const ListenerLimits& limits,
                   std::shared_ptr<LendTable> table, std::shared_ptr<ClaimTable> claims)
    : listen_fd_(fd),
      wake_fd_(wake_fd),
      port_(port),
      limits_(limits),
      table_(std::move(table)),
      claims_(std::move(claims)),
      auth_(limits.token.empty() ? nullptr
                                 : std::make_unique<rpc::internal::AuthChecker>(limits.token)) {
  acceptor_ = std::thread([this] { accept_loop(); });
}

Listener::~Listener() {
  shutdown();
  ::close(listen_fd_);
  ::close(wake_fd_);
}

void Listener::shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& c : connections_) ::shutdown(c->fd, SHUT_RDWR);
  }
  if (claims_ != nullptr) claims_->close();
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
  if (acceptor_.joinable()) acceptor_.join();
  std::list<std::unique_ptr<Connection>> all;
  {
    absl::MutexLock lock(&mu_);
    all.swap(connections_);
  }
  for (auto& c : all) {
    if (c->thread.joinable()) c->thread.join();
    ::close(c->fd);
  }
}

int Listener::connections() {
  absl::MutexLock lock(&mu_);
  reap_locked();
  return static_cast<int>(connections_.size());
}

void Listener::reap_locked() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    Connection* c = it->get();
    if (c->done.load()) {
      if (c->thread.joinable()) c->thread.join();  // it has returned, or is about to
      ::close(c->fd);
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

void Listener::accept_loop() {
  pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  for (;;) {
    const int n = ::poll(fds, 2, 1000);
    if (n < 0 && errno != EINTR) break;
    if (fds[1].revents != 0) break;
    if (n <= 0 || fds[0].revents == 0) {
      table_->expire();
      absl::MutexLock lock(&mu_);
      reap_locked();
      continue;
    }
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        LOG(WARNING) << "bulk listener on port " << port_ << ": accept: " << strerror(errno);
        ::usleep(10000);
      }
      continue;
    }
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      ::close(fd);
      break;
    }
    reap_locked();
    // Connections not proven yet: the oldest gives way to the new one.
    int unproven = 0;
    Connection* oldest = nullptr;
    for (auto& c : connections_) {
      if (c->proven.load() || c->done.load() || c->evicted) continue;
      ++unproven;
      if (oldest == nullptr || c->opened < oldest->opened) oldest = c.get();
    }
    if (unproven >= limits_.max_unauthenticated_connections && oldest != nullptr) {
      oldest->evicted = true;
      ::shutdown(oldest->fd, SHUT_RDWR);
    }
    int one = 1;  // a reply's last segment goes without waiting for the previous one's ACK
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    set_keepalive(fd);
    auto c = std::make_unique<Connection>();
    c->fd = fd;
    c->opened = absl::Now();
    Connection* raw = c.get();
    try {
      c->thread = std::thread([this, raw] { serve(raw); });
    } catch (const std::system_error& e) {
      LOG(WARNING) << "bulk listener on port " << port_ << ": no thread for a connection: "
                   << e.what();
      ::close(fd);
      continue;
    }
    connections_.push_back(std::move(c));
  }
}

int Listener::handshake(Connection* c) {
  // The whole hello within handshake_timeout of the connection's opening,
  // however its bytes are spread out.
  const absl::Time deadline = c->opened + limits_.handshake_timeout;
  const absl::Duration silence = limits_.handshake_timeout;
  char fixed[kHelloFixedBytes];
  absl::Status ok = read_exact(c->fd, fixed, sizeof(fixed), silence, deadline);
  if (!ok.ok()) return -1;
  const bool push = std::memcmp(fixed, kPushHelloMagic, 4) == 0 && claims_ != nullptr;
  if (!push && std::memcmp(fixed, kHelloMagic, 4) != 0) {
    LOG(WARNING) << "bulk listener on port " << port_ << ": a connection sent no bulk hello";
    return -1;
  }
  const uint32_t from = get_u32(fixed + 4);
  const uint32_t to = get_u32(fixed + 8);
  const uint32_t proof_size = get_u32(fixed + 12);
  if (from >= static_cast<uint32_t>(limits_.world_size) ||
      (limits_.self >= 0 && to != static_cast<uint32_t>(limits_.self)) ||
      proof_size > kMaxProofBytes) {
    LOG(WARNING) << "bulk listener of worker " << limits_.self << ": refused a hello from worker "
                 << from << " to worker " << to << " with a proof of " << proof_size << " bytes";
    return -1;
  }
  std::string proof(proof_size, '\0');
  ok = read_exact(c->fd, proof.data(), proof.size(), silence, deadline);
  if (!ok.ok()) return -1;
  if (auth_ != nullptr) {
    grpc::Status proven = auth_->check_proof(
        proof, {"rpc", push ? "bulk-push" : "bulk", static_cast<int>(from), limits_.self});
    if (!proven.ok()) {
      LOG(WARNING) << "bulk listener of worker " << limits_.self
                   << ": refused a connection naming worker " << from << ": "
                   << proven.error_message();
      return -1;
    }
  }
  {
    absl::MutexLock lock(&mu_);
    if (c->evicted) return -1;
    // A worker past its count: its oldest connection gives way (one its
    // puller gave up on, say, after a partition), so that it is never
    // locked out.
    int open = 0;
    Connection* oldest = nullptr;
    for (auto& other : connections_) {
      if (other.get() == c || !other->proven.load() || other->done.load() || other->evicted ||
          other->peer != static_cast<int>(from)) {
        continue;
      }
      ++open;
      if (oldest == nullptr || other->opened < oldest->opened) oldest = other.get();
    }
    if (open >= limits_.max_connections_per_peer && oldest != nullptr) {
      oldest->evicted = true;
      ::shutdown(oldest->fd, SHUT_RDWR);
    }
    c->peer = static_cast<int>(from);
    c->push = push;
    c->proven.store(true);
  }
  ok = write_all(c->fd, kHelloAck, sizeof(kHelloAck), silence, deadline);
  if (!ok.ok()) return -1;
  set_silence(c->fd, limits_.silence);
  return static_cast<int>(from);
}

void Listener::serve_pushes(Connection* c, int peer) {
  for (;;) {
    char head[kPushHeadBytes];
    // Idle connections wait for their next push without a limit.
    if (!read_exact(c->fd, head, 1, absl::InfiniteDuration()).ok() ||
        !read_exact(c->fd, head + 1, sizeof(head) - 1, limits_.silence,
                    absl::Now() + limits_.silence)
             .ok()) {
      return;
    }
    const uint64_t id = get_u64(head), total = get_u64(head + 8);
    const uint32_t index = get_u32(head + 16), ranges = get_u32(head + 20);
    std::shared_ptr<ClaimTable::Claim> claim;
    char* dst = nullptr;
    uint64_t length = 0;
    absl::Status ok = claims_->begin_range(peer, id, total, ranges, index, limits_.silence,
                                           &claim, &dst, &length);
    if (!ok.ok()) {
      LOG(WARNING) << "bulk listener of worker " << limits_.self << ": worker " << peer
                   << " pushed " << ok.message() << "; its connection ends";
      return;
    }
    ok = read_exact_blocking(c->fd, dst, length,
                             transfer_deadline(absl::Now(), limits_.silence, length));
    claims_->end_range(claim, ok.ok());
    if (!ok.ok()) return;
  }
}

void Listener::serve(Connection* c) {
  const int peer = handshake(c);
  if (peer >= 0 && c->push) {
    serve_pushes(c, peer);
    ::shutdown(c->fd, SHUT_RDWR);
    c->done.store(true);
    return;
  }
  while (peer >= 0) {
    char pull[kPullBytes];
    // Idle connections wait for their next pull without a limit; shutdown()
    // ends the wait.
    if (!read_exact(c->fd, pull, 1, absl::InfiniteDuration()).ok() ||
        !read_exact(c->fd, pull + 1, sizeof(pull) - 1, limits_.silence,
                    absl::Now() + limits_.silence)
             .ok()) {
      break;
    }
    const uint64_t id = get_u64(pull), offset = get_u64(pull + 8), length = get_u64(pull + 16);
    if (offset == kReleaseOffset && length == 0) {
      table_->release(peer, id);
      continue;
    }
    absl::StatusOr<LendTable::LentBytes> tensor = table_->find(peer, id, offset, length);
    char head[kReplyHeadBytes] = {};
    if (!tensor.ok()) {
      LOG(WARNING) << "bulk listener of worker " << limits_.self << ": worker " << peer
                   << " pulled " << tensor.status().message() << "; its connection ends";
      put_u32(head, tensor.status().code() == absl::StatusCode::kNotFound ? kPullUnknownLend
                                                                           : kPullOutOfRange);
      (void)write_all(c->fd, head, sizeof(head), limits_.silence);
      break;
    }
    put_u64(head + 8, length);
    const char* data = tensor->data + offset;
    // The socket blocks (set_silence after the hello): the kernel fills it
    // as it drains, without a poll per segment. A puller that drains it
    // slowly is cut off as a slow pull is (silence + its bytes at the
    // least rate), not only when it stops.
    const absl::Time deadline = transfer_deadline(absl::Now(), limits_.silence, length);
    if (!write_all_blocking(c->fd, head, sizeof(head), deadline).ok() ||
        !write_all_blocking(c->fd, data, length, deadline).ok()) {
      break;
    }
  }
  ::shutdown(c->fd, SHUT_RDWR);
  c->done.store(true);
}

}  // namespace ddprpc::rpc::transport::bulk
