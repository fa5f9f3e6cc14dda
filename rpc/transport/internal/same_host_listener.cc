#include "rpc/transport/internal/same_host_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "rpc/core/internal/auth.h"
#include "rpc/core/internal/fault.h"
#include "rpc/core/internal/thread_policy.h"
#include "rpc/core/security.h"
#include "rpc/transport/internal/caller_table.h"
#include "rpc/transport/internal/reading_role.h"
#include "rpc/transport/internal/same_host_process.h"
#include "rpc/transport/internal/same_host_protocol.h"
#include "rpc/transport/internal/spin_poll.h"

namespace ddprpc::rpc::transport::same_host {
namespace {

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
static_assert(kNobody == rpc::internal::ReadingRole::kNobody, "reading threads count from 1");
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
  int64_t unanswered_bytes ABSL_GUARDED_BY(mu) = 0;  // of those requests
  bool paused ABSL_GUARDED_BY(mu) = false;  // not read until replies go out
  int64_t reader ABSL_GUARDED_BY(mu) = kHandshake;
};

class SameHostResponder : public Responder {
 public:
  // Counts a request of `bytes` against `conn` until it is answered or dropped.
  SameHostResponder(std::shared_ptr<ServerConn> conn, int64_t bytes)
      : conn_(std::move(conn)), bytes_(bytes) {
    absl::MutexLock lock(&conn_->mu);
    ++conn_->unanswered;
    conn_->unanswered_bytes += bytes_;
  }
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
      conn_->unanswered_bytes -= bytes_;
      wake = conn_->paused;
    }
    if (wake) conn_->conn->wake();
  }
  const std::shared_ptr<ServerConn> conn_;
  const int64_t bytes_;
  std::atomic<bool> answered_{false};
};

class SameHostServer : public Listener, public std::enable_shared_from_this<SameHostServer> {
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
      s->role_.add_thread();
    }
    s->acceptor_ = std::thread([self = s.get()] {
      rpc::internal::apply_thread_policy(self->settings_->options.batch_scheduling);
      self->accept_loop();
    });
    s->watchdog_.start(s->settings_->options.batch_scheduling);
    return s;
  }

  // shutdown() must have been called (it joins the threads).
  ~SameHostServer() override {
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    if (poke_fd_ >= 0) ::close(poke_fd_);
    if (reserve_fd_ >= 0) ::close(reserve_fd_);
  }

  const std::string& name() const override { return name_; }

  void shutdown(absl::Duration grace) override {
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
      role_.stop();
    }
    poke();
    watchdog_.stop();
    role_.join();
    absl::MutexLock lock(&mu_);
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
        callers_(limits.world_size, limits.max_streams_per_worker),
        buffered_of_worker_(std::max(limits.world_size, 1), 0),
        role_(&mu_,
              {"rpc same-host transport", settings_->options.batch_scheduling, kMaxIdleThreads},
              [this](int64_t me) { hold_role(me); }),
        watchdog_(&mu_, absl::ZeroDuration(), [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return look();
        }) {}

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
        // At the worker's limit, its oldest connection gives way
        // (CallerTable).
        c = std::make_shared<ServerConn>(next_key_++, h->uid);
        replaced = callers_.admit(hello.worker, c);
        if (replaced) conns_.erase(replaced->key);
      }
    }
    if (replaced) {
      LOG(WARNING) << "rpc same-host transport: a newer connection of worker " << hello.worker
                   << " replaces " << replaced->address;
      epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, replaced->conn->fd(), nullptr);
      replaced->conn->send_control(kGoodbye, 0, 0,
                                   "replaced by a newer connection of the same worker");
      // On the acceptor, which must not wait on a connection its peer does
      // not read: what goes out at once goes, the rest is dropped.
      replaced->conn->shutdown_after_flush(absl::ZeroDuration());
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

  // Wakes the role holder to look at the poked connections (and at
  // whether the role stopped).
  void poke() {
    uint64_t one = 1;
    ssize_t ignored = ::write(poke_fd_, &one, sizeof(one));
    (void)ignored;
  }

  // Serves connections while thread `me` holds the reading role.
  void hold_role(int64_t me) {
    for (;;) {
      std::shared_ptr<ServerConn> c;
      bool sweep = false;
      {
        absl::MutexLock lock(&mu_);
        if (!role_.held_by(me) || role_.stopped()) return;
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
  // The live ones go back through the queue, not straight back to idle: an
  // event that came while this thread held one was taken off the queue
  // without anyone reading it (take_ready skips a connection that has a
  // reader), and its one-shot arming is spent.
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
    bool requeued = false;
    for (auto& c : idle) {
      absl::Status alive = c->conn->check_peer_alive();
      if (!alive.ok()) {
        set_busy(c, me);  // ending may wait for writes to go out
        finish(c, alive, /*clean=*/false);
        clear_busy(me);
        continue;
      }
      requeue(c, me, /*wake=*/false);
      requeued = true;
    }
    if (!requeued) return;
    bool holder;
    {
      absl::MutexLock lock(&mu_);
      holder = role_.held_by(me);
    }
    if (!holder) poke();  // the role moved on while a dead peer was ended
  }

  // Serves `c` (read by `me`) until it has no message, is paused, ended or
  // taken away, or had its share; false when `me` lost the role.
  bool serve(const std::shared_ptr<ServerConn>& c, int64_t me) {
    for (int served = 0;;) {
      const Next next = step(c, me, /*after_message=*/served > 0);
      bool lost;
      {
        absl::MutexLock lock(&mu_);
        lost = !role_.held_by(me);
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
      c->paused = full || c->unanswered >= limits_.max_pending_requests ||
                  c->unanswered_bytes > limits_.max_pending_request_bytes;
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
    auto responder = std::make_shared<SameHostResponder>(c, static_cast<int64_t>(frame.size()));
    bool run_here;
    {
      absl::MutexLock lock(&mu_);
      // A thread that lost the role runs nothing more.
      run_here = !frame.more_in_flight && handed_off_ < kMaxHandedOff && role_.held_by(me);
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
      if (!role_.held_by(me)) {
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
      if (!role_.held_by(me)) return;
      busy_since_ = absl::Now();
      busy_conn_ = c;
      busy_running_ = false;
    }
    note_inline_run();
  }
  void clear_busy(int64_t me) {
    absl::MutexLock lock(&mu_);
    if (role_.held_by(me)) clear_busy_locked();
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

  // The watchdog's look: gives the role to another thread when a message
  // has kept the holder for inline_handoff. The next look comes when the
  // message it saw would be overdue, or inline_handoff after it saw none
  // (no message that starts later is overdue before that); it parks once
  // kIdle has passed without a message, and a message that finds it parked
  // wakes it (note_inline_run). So the messages of a busy server wake it at
  // most once per inline_handoff and take the server's mutex only for their
  // own marks.
  absl::Duration look() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time now = absl::Now();
    if (hand_off_overdue() || messages_since_look_.exchange(false)) last_message_ = now;
    if (busy_since_ == absl::InfiniteFuture()) {
      return now - last_message_ >= kIdle ? absl::InfiniteDuration() : limits_.inline_handoff;
    }
    return std::max(busy_since_ + limits_.inline_handoff - now, kMinLook);
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
    role_.hand_off();
    return true;
  }

  // Keeps the watchdog ticking while messages come, and wakes it if it
  // parked.
  void note_inline_run() {
    messages_since_look_.store(true, std::memory_order_relaxed);
    watchdog_.wake();
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
    if (conns_.erase(c->key) > 0 && c->caller >= 0) callers_.release(c->caller, c);
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

  absl::Mutex mu_;
  // State below is protected by mu_.
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::map<uint64_t, std::shared_ptr<ServerConn>> conns_ ABSL_GUARDED_BY(mu_);
  uint64_t next_key_ ABSL_GUARDED_BY(mu_) = kPokeKey + 1;
  // The admitted connections, by the worker each proved it speaks for.
  rpc::internal::CallerTable<std::shared_ptr<ServerConn>> callers_ ABSL_GUARDED_BY(mu_);
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
  absl::Time last_message_ ABSL_GUARDED_BY(mu_) = absl::Now();  // seen by the watchdog
  // Set by every message; each look of the watchdog clears it.
  std::atomic<bool> messages_since_look_{false};
  // Declared last: their threads use the state above.
  rpc::internal::ReadingRole role_;
  rpc::internal::RoleWatchdog watchdog_;
};

}  // namespace

std::shared_ptr<Listener> start_listener(const ServerLimits& limits, const Security& security,
                                         Transport::CheckRequest check,
                                         Transport::OnRequest run_inline,
                                         Transport::OnRequest offload,
                                         std::shared_ptr<const Settings> settings) {
  return SameHostServer::start(limits, security, std::move(check), std::move(run_inline),
                               std::move(offload), std::move(settings));
}

}  // namespace ddprpc::rpc::transport::same_host
