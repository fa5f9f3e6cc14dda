#include "rpc/transport/bulk_transport.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "rpc/core/errors.h"
#include "rpc/transport/spin_budget.h"
#include "rpc/transport/internal/bulk_claims.h"
#include "rpc/transport/internal/bulk_lender.h"
#include "rpc/transport/internal/bulk_pull_pool.h"
#include "rpc/transport/internal/bulk_puller.h"
#include "rpc/transport/internal/bulk_pusher.h"
#include "rpc/transport/internal/bulk_receive_cache.h"

namespace ddprpc::rpc::transport {
namespace {

bool has_lent(const Frame& frame) {
  for (const auto& meta : frame.header.tensors()) {
    if (meta.lent() != 0) return true;
  }
  return false;
}

// The deliveries of one server or channel, ended by its shutdown or
// close: one that would start after that is dropped, and the end waits for
// those running (but not for one running on the calling thread).
class DeliveryGate {
 public:
  // Runs `deliver` unless the gate is closed.
  void run(const std::function<void()>& deliver) {
    const std::thread::id me = std::this_thread::get_id();
    {
      absl::MutexLock lock(&mu_);
      if (closed_) return;
      running_.push_back(me);
    }
    struct Done {
      DeliveryGate* gate;
      std::thread::id me;
      ~Done() {
        absl::MutexLock lock(&gate->mu_);
        gate->running_.erase(std::find(gate->running_.begin(), gate->running_.end(), me));
      }
    } done{this, me};
    deliver();
  }
  bool closed() const {
    absl::MutexLock lock(&mu_);
    return closed_;
  }
  void close() {
    const std::thread::id me = std::this_thread::get_id();
    absl::MutexLock lock(&mu_);
    closed_ = true;
    auto others_done = [this, me]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return std::all_of(running_.begin(), running_.end(),
                         [me](std::thread::id id) { return id == me; });
    };
    mu_.Await(absl::Condition(&others_done));
  }

 private:
  mutable absl::Mutex mu_;
  // State below is protected by mu_.
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread::id> running_ ABSL_GUARDED_BY(mu_);  // a thread per delivery
};

// What a bulk transport's servers and channels share.
class BulkState : public std::enable_shared_from_this<BulkState> {
 public:
  BulkState(const BulkOptions& options, Transport* inner)
      : options_(options),
        inner_(inner),
        pool_(bulk::PullPoolOptions{std::max(1, options.pull_threads), absl::Seconds(10)}),
        cache_(options.receive_cache_bytes > 0
                   ? bulk::ReceiveCache::create(
                         {options.receive_cache_bytes, options.receive_cache_idle_time})
                   : nullptr),
        claims_(options.push ? std::make_shared<bulk::ClaimTable>(bulk::ClaimLimits{
                                   1024, options.max_lent_bytes_per_peer})
                             : nullptr),
        pushing_(options.push && usable_cpus() >= options.push_min_cpus) {}

  const std::shared_ptr<bulk::ClaimTable>& claims() const { return claims_; }

  const BulkOptions& options() const { return options_; }

  // Ends the pulls that run and drops the queued ones; returns once the
  // pool's threads have left. The transport calls it before it lets its
  // wrapped transport go: deliveries use that one.
  void stop() {
    std::vector<std::shared_ptr<bulk::Puller>> pullers;
    std::map<int, std::shared_ptr<bulk::Pusher>> pushers;
    {
      absl::MutexLock lock(&mu_);
      stopped_ = true;
      for (auto& [peer, puller] : pullers_) pullers.push_back(puller);
      pushers.swap(pushers_);
    }
    for (auto& puller : pullers) puller->abort();
    // All at once, before any is joined: each may be connecting.
    for (auto& [peer, pusher] : pushers) pusher->abort();
    pushers.clear();  // ends their pushes and joins their threads
    pool_.stop();
    pool_.wait();
    if (cache_) cache_->close();
  }

  // Pulls `frame`'s lent tensors from `peer` on a pool thread, then passes
  // the frame, or the error that failed it, to `deliver` there through
  // `gate`. False (nothing queued) when the pool has stopped or has no
  // thread.
  bool pull_then(std::shared_ptr<DeliveryGate> gate, int peer, int self, std::string token,
                 int64_t max_message_bytes, Frame frame,
                 std::function<void(Frame, absl::Status)> deliver) {
    struct Pending {
      Frame frame;
      absl::Status status;
      // By tensor index: the claims of pushed tensors (null: pulled).
      std::vector<std::shared_ptr<bulk::ClaimTable::Claim>> claims;
      std::shared_ptr<bulk::ClaimTable> table;
      std::vector<uint64_t> pushed;  // lends that came pushed, to release
      ~Pending() {
        for (const auto& claim : claims) {
          if (claim != nullptr) table->drop(claim);
        }
      }
    };
    auto pending = std::make_shared<Pending>();
    pending->frame = std::move(frame);
    claim_pushed(&pending->frame, peer, max_message_bytes, &pending->claims);
    pending->table = claims_;
    auto state = shared_from_this();
    auto pull = [state, gate, pending, peer, self, token = std::move(token), max_message_bytes] {
      try {
        pending->status = gate->closed()
                              ? absl::CancelledError("its connection closed before the pull")
                              : state->fill(&pending->frame, peer, self, token, max_message_bytes,
                                            pending->claims, &pending->pushed);
      } catch (const std::exception& e) {
        // The frame is not whole: it must not be delivered as if it were.
        pending->status = absl::InternalError(
            absl::StrCat("pulling its lent tensors failed: ", e.what()));
      }
    };
    auto then = [state, gate, pending, peer, deliver = std::move(deliver)] {
      gate->run([&] { deliver(std::move(pending->frame), pending->status); });
      // A caller reading the wrapped transport may wait for what this
      // completed. (After stop() the wrapped transport may be gone: a
      // delivery destroyed the transport on this thread.)
      bool stopped;
      {
        absl::MutexLock lock(&state->mu_);
        stopped = state->stopped_;
      }
      if (!stopped) state->inner_->interrupt_drive();
      // Last: the lender may be slow to answer, or gone.
      if (!pending->pushed.empty()) state->release(peer, pending->pushed);
    };
    return pool_.submit(peer, std::move(pull), std::move(then));
  }
  std::shared_ptr<bulk::LendTable> table() {
    absl::MutexLock lock(&mu_);
    return table_;
  }
  // Replies lent to one caller and not yet pulled are bounded like the
  // replies a caller leaves unread on the wrapped transport.
  void set_max_reply_bytes(int64_t max_reply_bytes) {
    absl::MutexLock lock(&mu_);
    table_ = std::make_shared<bulk::LendTable>(options_.max_lent_bytes_per_peer,
                                               max_reply_bytes, options_.lend_timeout);
  }

  // `token` proves this worker on the connections it pushes over.
  void set_listening(bool on, const std::string& token = std::string()) {
    absl::MutexLock lock(&mu_);
    listening_ = on;
    if (on) token_ = token;
  }
  void set_endpoints(const std::vector<std::string>& endpoints) {
    absl::MutexLock lock(&mu_);
    endpoints_ = endpoints;
  }

  // Lends `frame`'s large tensors from `self` to `peer` when both have
  // published a bulk endpoint (and this transport listens on its own);
  // whether it lent any.
  // A lent tensor may be pushed: `*pusher` then starts its bytes once the
  // frame is sent (Pusher::start).
  bool lend(Frame* frame, int self, int peer, bool reply, std::shared_ptr<bulk::Pusher>* started,
            absl::Time not_before = absl::InfinitePast(), uint64_t channel = 0) {
    bool large = false;  // most frames have no large tensor: no lock for them
    for (const auto& meta : frame->header.tensors()) large |= meta.nbytes() >= options_.min_bytes;
    if (!large) return false;
    std::shared_ptr<bulk::LendTable> table;
    {
      absl::MutexLock lock(&mu_);
      table = table_;
      const int n = static_cast<int>(endpoints_.size());
      if (!listening_ || peer < 0 || peer >= n || self < 0 || self >= n ||
          endpoints_[peer].empty() || endpoints_[self].empty()) {
        return false;
      }
    }
    std::shared_ptr<bulk::Pusher> pusher = pushing_ ? pusher_for(self, peer) : nullptr;
    bool lent = false;
    auto* metas = frame->header.mutable_tensors();
    const int n = std::min<int>(metas->size(), static_cast<int>(frame->tensors.size()));
    for (int i = 0; i < n; ++i) {
      auto* meta = metas->Mutable(i);
      const at::Tensor& t = frame->tensors[i];
      if (!t.defined() || meta->lent() != 0 || meta->nbytes() < options_.min_bytes ||
          !t.device().is_cpu() || !t.is_contiguous()) {
        continue;
      }
      const uint64_t id = table->lend(peer, frame->header.id(), t, reply, not_before, channel);
      if (id == 0) break;  // the peer's bound: the rest travel in the frame
      meta->set_lent(id);
      meta->set_pushed(pusher != nullptr ? pusher->push(id, t) : 0);
      if (meta->pushed() != 0) *started = pusher;
      lent = true;
    }
    return lent;
  }

  // Each lent tensor's bytes were checked against its shape; their sum,
  // with the frame's, must be within `max_message_bytes`.
  static absl::Status check_lent_bytes(const Frame& frame, int64_t max_message_bytes) {
    uint64_t total = frame.size();
    for (const auto& meta : frame.header.tensors()) {
      if (meta.lent() != 0 && (__builtin_add_overflow(total, meta.nbytes(), &total) ||
                               total > static_cast<uint64_t>(max_message_bytes))) {
        return absl::ResourceExhaustedError(
            absl::StrCat("a frame with lent tensors exceeds max_message_bytes (",
                         max_message_bytes, ")"));
      }
    }
    return absl::OkStatus();
  }

  internal::EmptyTensor empty_tensor() {
    if (!cache_) return nullptr;  // the CPU allocator
    return [this](c10::ScalarType dtype, c10::IntArrayRef sizes) {
      return cache_->allocate(dtype, sizes);
    };
  }

  // On the thread that read `frame` (checked): counts each tensor `peer`
  // says it pushes against the peer's claim bounds, then allocates it and
  // claims its bytes, so that they may be read as they come; by tensor
  // index in `claims`. A frame beyond max_message_bytes, or a tensor that
  // cannot be claimed, is left to fill().
  void claim_pushed(Frame* frame, int peer, int64_t max_message_bytes,
                    std::vector<std::shared_ptr<bulk::ClaimTable::Claim>>* claims) {
    if (claims_ == nullptr) return;
    const auto& metas = frame->header.tensors();
    bool pushed = false;
    for (const auto& meta : metas) pushed |= meta.lent() != 0 && meta.pushed() != 0;
    if (!pushed || !check_lent_bytes(*frame, max_message_bytes).ok()) return;
    const internal::EmptyTensor empty = empty_tensor();
    claims->resize(metas.size());
    for (int i = 0; i < metas.size(); ++i) {
      const auto& meta = metas[i];
      if (meta.lent() == 0 || meta.pushed() == 0 || meta.nbytes() == 0) continue;
      // Counted against the peer's bounds before anything is allocated.
      std::shared_ptr<bulk::ClaimTable::Claim> claim =
          claims_->reserve(peer, meta.lent(), meta.nbytes(), meta.pushed());
      if (claim == nullptr) continue;  // pulled
      at::Tensor t;
      try {
        t = internal::allocate_tensor(meta, empty);
      } catch (const std::exception&) {
        claims_->drop(claim);
        continue;  // fill() reports it
      }
      if (claims_->ready(claim, std::move(t))) (*claims)[i] = std::move(claim);
    }
  }

  // Tells `peer` that its lends `ids` arrived pushed.
  void release(int peer, const std::vector<uint64_t>& ids) {
    std::shared_ptr<bulk::Puller> puller;
    {
      absl::MutexLock lock(&mu_);
      auto it = pullers_.find(peer);
      if (stopped_ || it == pullers_.end()) return;
      puller = it->second;
    }
    for (uint64_t id : ids) puller->release(id);
  }

  // The pusher of lends from `self` to `peer`, made on first use.
  std::shared_ptr<bulk::Pusher> pusher_for(int self, int peer) {
    absl::MutexLock lock(&mu_);
    if (stopped_ || peer < 0 || peer >= static_cast<int>(endpoints_.size())) return nullptr;
    auto& slot = pushers_[peer];
    if (slot == nullptr) {
      bulk::PusherOptions po;
      po.self = self;
      po.receiver = peer;
      po.endpoint = endpoints_[peer];
      po.token = token_;
      po.streams = options_.streams;
      po.silence = options_.silence;
      slot = std::make_shared<bulk::Pusher>(std::move(po));
    }
    return slot;
  }

  // Allocates `frame`'s lent tensors and has their bytes: pushed into the
  // tensors `claims` name, or pulled from `peer`.
  absl::Status fill(Frame* frame, int peer, int self, const std::string& token,
                    int64_t max_message_bytes,
                    const std::vector<std::shared_ptr<bulk::ClaimTable::Claim>>& claims,
                    std::vector<uint64_t>* pushed) {
    if (!has_lent(*frame)) return absl::OkStatus();
    // Checked before anything is allocated.
    absl::Status within = check_lent_bytes(*frame, max_message_bytes);
    if (!within.ok()) return within;
    std::shared_ptr<bulk::Puller> puller;
    {
      absl::MutexLock lock(&mu_);
      // A peer that knows the world may lend before this worker has read
      // every worker's record.
      auto known = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !endpoints_.empty() || stopped_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&known), options_.silence);
      if (stopped_) return absl::CancelledError("the transport is shutting down");
      if (peer < 0 || peer >= static_cast<int>(endpoints_.size()) || endpoints_[peer].empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("worker ", peer, " lent tensors but has no bulk endpoint"));
      }
      auto& slot = pullers_[peer];
      if (slot == nullptr) {
        bulk::PullerOptions po;
        po.self = self;
        po.lender = peer;
        po.endpoint = endpoints_[peer];
        po.token = token;
        po.streams = options_.streams;
        po.silence = options_.silence;
        slot = std::make_shared<bulk::Puller>(std::move(po));
      }
      puller = slot;
    }
    const internal::EmptyTensor empty = empty_tensor();
    auto* metas = frame->header.mutable_tensors();
    for (int i = 0; i < metas->size(); ++i) {
      auto* meta = metas->Mutable(i);
      if (meta->lent() == 0) continue;
      const auto& claim = i < static_cast<int>(claims.size()) ? claims[i] : nullptr;
      at::Tensor t;
      bool arrived = false;  // pushed whole
      if (claim != nullptr) {
        t = claim->tensor;
        arrived = claims_->await(
            claim, options_.push_start_wait,
            bulk::transfer_deadline(claim->made, options_.silence, meta->nbytes()));
        if (arrived) pushed->push_back(meta->lent());
      } else {
        try {
          t = internal::allocate_tensor(*meta, empty);
        } catch (const std::exception&) {
          return absl::ResourceExhaustedError(
              absl::StrCat("no memory for a lent tensor of ", meta->nbytes(), " bytes"));
        }
      }
      if (!arrived && meta->nbytes() > 0) {
        absl::Status pulled = puller->pull(meta->lent(), t.data_ptr(), meta->nbytes());
        if (!pulled.ok()) return pulled;
      }
      frame->tensors[i] = std::move(t);
      meta->set_lent(0);
      meta->clear_pushed();
    }
    return absl::OkStatus();
  }

 private:
  const BulkOptions options_;
  Transport* const inner_;  // outlives the pool's threads (stop())
  bulk::PullPool pool_;
  // Memory for pulled tensors; null when off.
  const std::shared_ptr<bulk::ReceiveCache> cache_;
  // Tensors being pushed to this worker; null when pushes are off.
  const std::shared_ptr<bulk::ClaimTable> claims_;
  const bool pushing_;  // this worker pushes what it lends
  absl::Mutex mu_;
  // State below is protected by mu_.
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  // Set by the transport's server (it serves the pulls); null before.
  std::shared_ptr<bulk::LendTable> table_ ABSL_GUARDED_BY(mu_);
  bool listening_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::string> endpoints_ ABSL_GUARDED_BY(mu_);  // by rank; empty: none
  std::map<int, std::shared_ptr<bulk::Puller>> pullers_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::shared_ptr<bulk::Pusher>> pushers_ ABSL_GUARDED_BY(mu_);
  std::string token_ ABSL_GUARDED_BY(mu_);  // proves pushes
};

// An error frame answering frame `id` in the name of worker `src`.
Frame error_frame(uint64_t id, int src, const absl::Status& why) {
  Frame f;
  f.header.set_id(id);
  f.header.set_kind(wire::ERROR);
  f.header.set_src(src);
  f.header.set_error_code(static_cast<int>(ErrorCode::kUnavailable));
  f.header.set_error(std::string(why.message()));
  return f;
}

class BulkResponder : public Responder {
 public:
  BulkResponder(std::shared_ptr<BulkState> state, std::shared_ptr<Responder> inner, int self,
                int64_t max_message_bytes)
      : state_(std::move(state)),
        inner_(std::move(inner)),
        self_(self),
        max_message_bytes_(max_message_bytes) {}
  void send(Frame reply) override {
    std::shared_ptr<bulk::Pusher> pusher;
    bool sent = false;
    // Pushes start once the frame is on its way, and are dropped if sending
    // threw: a push left waiting would hold its connections.
    absl::Cleanup start_pushes = [&] {
      if (pusher != nullptr) pusher->start(/*cancel=*/!sent);
    };
    if (reply.size() <= static_cast<uint64_t>(max_message_bytes_)) {
      state_->lend(&reply, self_, inner_->caller(), /*reply=*/true, &pusher);
    }
    inner_->send(std::move(reply));
    sent = true;
  }
  bool answered() const override { return inner_->answered(); }
  int caller() const override { return inner_->caller(); }
  const std::string& address() const override { return inner_->address(); }

 private:
  const std::shared_ptr<BulkState> state_;
  const std::shared_ptr<Responder> inner_;
  const int self_;
  const int64_t max_message_bytes_;
};

class BulkServer : public Server {
 public:
  BulkServer(std::shared_ptr<BulkState> state, std::shared_ptr<DeliveryGate> gate,
             std::unique_ptr<Server> inner, std::unique_ptr<bulk::Listener> listener,
             std::string endpoint)
      : state_(std::move(state)),
        gate_(std::move(gate)),
        inner_(std::move(inner)),
        listener_(std::move(listener)),
        endpoint_(std::move(endpoint)) {}
  ~BulkServer() override {
    gate_->close();
    state_->set_listening(false);
    listener_->shutdown();
  }
  int port() const override { return inner_->port(); }
  std::string same_host_endpoint() const override { return inner_->same_host_endpoint(); }
  std::string bulk_endpoint() const override { return endpoint_; }
  // Callers may still pull the replies answered in the grace period.
  void shutdown(absl::Duration grace) override {
    inner_->shutdown(grace);
    gate_->close();  // requests still being pulled are dropped unanswered
    state_->set_listening(false);
    listener_->shutdown();
  }

 private:
  const std::shared_ptr<BulkState> state_;
  const std::shared_ptr<DeliveryGate> gate_;
  const std::unique_ptr<Server> inner_;
  const std::unique_ptr<bulk::Listener> listener_;
  const std::string endpoint_;
};

class BulkChannel : public Channel {
 public:
  BulkChannel(std::shared_ptr<BulkState> state, std::shared_ptr<DeliveryGate> gate, int self,
              int peer, int64_t max_message_bytes)
      : state_(std::move(state)),
        gate_(std::move(gate)),
        self_(self),
        peer_(peer),
        max_message_bytes_(max_message_bytes) {}
  void set_inner(std::shared_ptr<Channel> inner) { inner_ = std::move(inner); }
  // Ends the wrapped channel (OnClose follows), from a delivery.
  void end_inner() { inner_->close(/*graceful=*/false); }

  bool send(Frame frame, const SendOptions& options) override {
    // An oversized frame goes as it is, for the wrapped transport to refuse.
    // Its lends last until the call's deadline if that is later than the
    // lend timeout; a call without one gets the lend timeout.
    const absl::Time keep =
        options.deadline == absl::InfiniteFuture() ? absl::InfinitePast() : options.deadline;
    std::shared_ptr<bulk::Pusher> pusher;
    bool sent = false;
    // As in BulkResponder::send.
    absl::Cleanup start_pushes = [&] {
      if (pusher != nullptr) pusher->start(/*cancel=*/!sent);
    };
    const bool lent = frame.size() <= static_cast<uint64_t>(max_message_bytes_) &&
                      state_->lend(&frame, self_, peer_, /*reply=*/false, &pusher, keep, tag_);
    const uint64_t id = frame.header.id();
    sent = inner_->send(std::move(frame), options);
    std::move(start_pushes).Invoke();
    if (!sent && lent) {
      if (auto table = state_->table()) table->release_request(peer_, id);
    }
    return sent;
  }
  bool broken() const override { return inner_->broken(); }
  void drive(const std::function<bool()>& done, absl::Time deadline) override {
    inner_->drive(done, deadline);
  }
  void check_connection() override { inner_->check_connection(); }
  void begin_close() override { inner_->begin_close(); }
  // Replies still being pulled are dropped: their calls fail with the
  // channel, and so do its requests' lends.
  void close(bool graceful) override {
    inner_->close(graceful);
    gate_->close();
    release_lends(state_, peer_, tag_);
  }
  // Names this channel's request lends.
  uint64_t tag() const { return tag_; }
  static void release_lends(const std::shared_ptr<BulkState>& state, int peer, uint64_t tag) {
    if (auto table = state->table()) table->release_channel(peer, tag);
  }

 private:
  const std::shared_ptr<BulkState> state_;
  const std::shared_ptr<DeliveryGate> gate_;
  const int self_;
  const int peer_;
  const int64_t max_message_bytes_;
  const uint64_t tag_ = next_tag();
  std::shared_ptr<Channel> inner_;

  static uint64_t next_tag() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1);
  }
};

class BulkTransport : public Transport {
 public:
  BulkTransport(std::shared_ptr<Transport> inner, const BulkOptions& options)
      : inner_(std::move(inner)), state_(std::make_shared<BulkState>(options, inner_.get())) {}
  ~BulkTransport() override { state_->stop(); }

  std::unique_ptr<Server> listen(const std::string& host, const ServerLimits& limits,
                                 const Security& security, CheckRequest check,
                                 OnRequest run_inline, OnRequest offload) override {
    if (security.encrypted()) {
      return inner_->listen(host, limits, security, std::move(check), std::move(run_inline),
                            std::move(offload));
    }
    bulk::ListenerLimits ll;
    ll.self = limits.self;
    ll.world_size = limits.world_size;
    ll.token = security.token;
    ll.max_unauthenticated_connections = limits.max_unauthenticated_connections;
    ll.handshake_timeout = limits.handshake_timeout;
    ll.max_connections_per_peer = 4 * std::max(1, state_->options().streams);
    ll.silence = state_->options().silence;
    state_->set_max_reply_bytes(limits.max_pending_reply_bytes);
    std::string error;
    std::unique_ptr<bulk::Listener> listener =
        bulk::Listener::start(host, ll, state_->table(), state_->claims(), &error);
    if (listener == nullptr) {
      // Tensors then travel in their frames; peers see no bulk endpoint.
      LOG(WARNING) << "worker " << limits.self << ": no bulk path (" << error << ")";
      return inner_->listen(host, limits, security, std::move(check), std::move(run_inline),
                            std::move(offload));
    }
    ServerLimits inner_limits = limits;
    inner_limits.accept_lent_tensors = true;
    const int self = limits.self;
    const int64_t max_bytes = limits.max_message_bytes;
    auto gate = std::make_shared<DeliveryGate>();
    // A request with lent tensors goes to `offload` once they are pulled,
    // from the pull's thread; the others go to `next` as they come.
    auto wrap = [state = state_, gate, self, max_bytes, token = security.token,
                 offload](OnRequest next) {
      return [state, gate, self, max_bytes, token, offload, next = std::move(next)](
                 std::shared_ptr<Responder> responder, Frame frame) {
        auto bulk_responder = std::make_shared<BulkResponder>(state, responder, self, max_bytes);
        if (!has_lent(frame)) {
          next(std::move(bulk_responder), std::move(frame));
          return;
        }
        const int caller = responder->caller();
        const uint64_t id = frame.header.id();
        const bool request = frame.header.kind() == wire::REQUEST;
        auto fail = [self, caller, id, request, responder](const absl::Status& why) {
          LOG(WARNING) << "worker " << self << ": a request from worker " << caller
                       << " fails: " << why.message();
          if (request) responder->send(error_frame(id, self, why));
        };
        const bool queued = state->pull_then(
            gate, caller, self, token, max_bytes, std::move(frame),
            [offload, fail, bulk_responder](Frame frame, absl::Status pulled) {
              if (!pulled.ok()) {
                fail(pulled);
                return;
              }
              offload(bulk_responder, std::move(frame));
            });
        if (!queued) fail(absl::UnavailableError("no thread can pull its lent tensors"));
      };
    };
    std::unique_ptr<Server> server = inner_->listen(host, inner_limits, security, std::move(check),
                                                    wrap(run_inline), wrap(offload));
    const bool bare_ipv6 = host.find(':') != std::string::npos && host.front() != '[';
    const std::string endpoint =
        absl::StrCat(bare_ipv6 ? "[" + host + "]" : host, ":", listener->port());
    state_->set_listening(true, security.token);
    return std::make_unique<BulkServer>(state_, std::move(gate), std::move(server),
                                        std::move(listener), endpoint);
  }

  std::shared_ptr<Channel> connect(const std::string& address, const PeerOptions& options,
                                   Channel::OnFrame on_frame, Channel::OnClose on_close) override {
    if (options.security.encrypted()) {
      return inner_->connect(address, options, std::move(on_frame), std::move(on_close));
    }
    const int peer = options.peer;
    const int self = options.self;
    auto gate = std::make_shared<DeliveryGate>();
    auto channel = std::make_shared<BulkChannel>(state_, gate, self, peer,
                                                 options.max_message_bytes);
    PeerOptions inner_options = options;
    inner_options.accept_lent_tensors = true;
    // A reply with lent tensors reaches `next` from the pull's thread once
    // they are pulled (or as the error that failed it); a reply that breaks
    // the protocol then ends the channel.
    auto next = std::make_shared<Channel::OnFrame>(std::move(on_frame));
    std::weak_ptr<BulkChannel> weak = channel;
    Channel::OnFrame wrapped = [state = state_, gate, peer, self, token = options.security.token,
                                max = options.max_message_bytes, next, weak](Frame frame) {
      const uint64_t id = frame.header.id();
      if (auto table = state->table()) {
        table->release_request(peer, id);  // the request's lends, if not pulled
      }
      if (!has_lent(frame)) return (*next)(std::move(frame));
      auto deliver = [self, peer, next, weak](Frame frame, absl::Status pulled) {
        if (!pulled.ok()) {
          LOG(WARNING) << "worker " << self << ": a reply from worker " << peer
                       << " fails: " << pulled.message();
          frame = error_frame(frame.header.id(), peer, pulled);
        }
        absl::Status ok = (*next)(std::move(frame));
        if (ok.ok()) return;
        LOG(WARNING) << "worker " << self << ": ending the channel to worker " << peer << ": "
                     << ok.message();
        if (auto channel = weak.lock()) channel->end_inner();
      };
      if (!state->pull_then(gate, peer, self, token, max, std::move(frame), deliver)) {
        Frame failed;
        failed.header.set_id(id);
        deliver(std::move(failed), absl::UnavailableError("no thread can pull its lent tensors"));
      }
      return absl::OkStatus();
    };
    // A channel that ends (its peer gone, say) releases its requests' lends
    // at once, not at their calls' deadlines.
    Channel::OnClose closed = [state = state_, peer, tag = channel->tag(),
                               on_close = std::move(on_close)](const CloseReason& why) {
      BulkChannel::release_lends(state, peer, tag);
      if (on_close) on_close(why);
    };
    channel->set_inner(
        inner_->connect(address, inner_options, std::move(wrapped), std::move(closed)));
    return channel;
  }

  void reserve_reading() override { inner_->reserve_reading(); }
  void release_reading() override { inner_->release_reading(); }
  void drive(const std::function<bool()>& done, absl::Time deadline) override {
    inner_->drive(done, deadline);
  }
  void interrupt_drive() override { inner_->interrupt_drive(); }
  void world_known(const std::vector<std::string>& same_host_endpoints,
                   const std::vector<std::string>& bulk_endpoints) override {
    state_->set_endpoints(bulk_endpoints);
    inner_->world_known(same_host_endpoints, bulk_endpoints);
  }
  bool probe(const std::string& address, const PeerOptions& options,
             absl::Time deadline) override {
    return inner_->probe(address, options, deadline);
  }

 private:
  const std::shared_ptr<Transport> inner_;
  const std::shared_ptr<BulkState> state_;
};

}  // namespace

std::shared_ptr<Transport> make_bulk_transport(std::shared_ptr<Transport> inner,
                                               const BulkOptions& options) {
  return std::make_shared<BulkTransport>(std::move(inner), options);
}

}  // namespace ddprpc::rpc::transport
