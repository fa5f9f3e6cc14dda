#include "elastic/membership_watch.h"

#include <algorithm>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "rpc/hooks.h"
#include "rpc/rendezvous/store.h"

namespace ddprpc::elastic {

// The queue of workers to remove and the thread that removes them. The
// hook reaches it through a weak pointer, so that a hook outliving its
// watch finds nothing.
class MembershipWatch::State {
 public:
  State(std::shared_ptr<rpc::Store> store, rpc::MembershipClient::Options options)
      : store_(std::move(store)),
        options_(std::move(options)),
        removing_(rpc::membership_store(store_.get()), options_) {}

  // A client of its own for a caller's thread (the store is shared).
  rpc::MembershipClient client() const {
    return rpc::MembershipClient(rpc::membership_store(store_.get()), options_);
  }

  void start_thread() {
    thread_ = std::thread([this] { run(); });
  }

  void stop() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }

  // From the hook, on an RPC thread: queues, never blocks on the store.
  // A worker removed before may have joined again since: it is removed
  // again (removing a worker that is out changes nothing).
  void lost(const std::string& worker) {
    absl::MutexLock lock(&mu_);
    queue_locked(worker);
  }

  std::vector<std::string> removals() {
    absl::MutexLock lock(&mu_);
    return done_;
  }

 private:
  // At most one entry per worker of the job: the queue stays bounded.
  void queue_locked(const std::string& worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (worker == removing_now_) return;
    for (const std::string& w : queue_) {
      if (w == worker) return;
    }
    if (queue_.size() < rpc::Membership::kMaxWorkers) queue_.push_back(worker);
  }

  void run() {
    for (;;) {
      std::string worker;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this] { return stopping_ || !queue_.empty(); };
        mu_.Await(absl::Condition(&ready));
        if (stopping_) return;
        worker = queue_.front();
        queue_.pop_front();
        removing_now_ = worker;
      }
      absl::StatusOr<rpc::Membership> m = removing_.remove(worker);
      std::string outcome = worker;
      absl::MutexLock lock(&mu_);
      removing_now_.clear();
      if (m.ok()) {
        backoff_ = kFirstBackoff;
        LOG(WARNING) << "membership: worker '" << worker << "' is out; epoch " << m->epoch;
      } else {
        LOG(WARNING) << "membership: could not remove worker '" << worker
                     << "': " << m.status().message() << "; trying again in "
                     << absl::FormatDuration(backoff_);
        outcome = absl::StrCat(worker, " (", m.status().message(), ")");
        // Its loss is not reported again (the hook fires once): tried
        // again, after a pause that grows while the store does not answer.
        mu_.AwaitWithTimeout(absl::Condition(&stopping_), backoff_);
        backoff_ = std::min(backoff_ * 2, kLastBackoff);
        if (!stopping_) queue_locked(worker);
      }
      // Bounded: failed removals may come back.
      if (done_.size() < 4 * rpc::Membership::kMaxWorkers) done_.push_back(std::move(outcome));
    }
  }

  static constexpr absl::Duration kFirstBackoff = absl::Milliseconds(200);
  static constexpr absl::Duration kLastBackoff = absl::Seconds(10);

  const std::shared_ptr<rpc::Store> store_;
  const rpc::MembershipClient::Options options_;
  rpc::MembershipClient removing_;  // the thread's own
  std::thread thread_;

  absl::Mutex mu_;
  // State below is protected by mu_.
  std::deque<std::string> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> done_ ABSL_GUARDED_BY(mu_);
  std::string removing_now_ ABSL_GUARDED_BY(mu_);
  absl::Duration backoff_ ABSL_GUARDED_BY(mu_) = kFirstBackoff;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

namespace {

// One hook for the process (hooks stay for its life, and every call walks
// them): it tells the watches alive now.
class LostWorkerHook final : public rpc::RpcHook {
 public:
  void add(std::weak_ptr<MembershipWatch::State> state) {
    absl::MutexLock lock(&mu_);
    states_.erase(std::remove_if(states_.begin(), states_.end(),
                                 [](const auto& s) { return s.expired(); }),
                  states_.end());
    states_.push_back(std::move(state));
  }
  void worker_unreachable(const rpc::WorkerInfo& worker, const std::string&) override {
    std::vector<std::shared_ptr<MembershipWatch::State>> live;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& s : states_) {
        if (auto state = s.lock()) live.push_back(std::move(state));
      }
    }
    for (const auto& state : live) state->lost(worker.name);
  }

 private:
  absl::Mutex mu_;
  std::vector<std::weak_ptr<MembershipWatch::State>> states_ ABSL_GUARDED_BY(mu_);
};

// Installed by the first watch.
LostWorkerHook& lost_worker_hook() {
  static LostWorkerHook* const hook = [] {
    auto installed = std::make_shared<LostWorkerHook>();
    rpc::add_rpc_hook(installed);
    return installed.get();  // kept by the process's hooks
  }();
  return *hook;
}

}  // namespace

absl::StatusOr<std::shared_ptr<MembershipWatch>> MembershipWatch::start(
    std::shared_ptr<rpc::Store> store, std::vector<std::string> members,
    rpc::MembershipClient::Options options) {
  auto state = std::make_shared<State>(std::move(store), options);
  absl::StatusOr<rpc::Membership> m = state->client().start(std::move(members));
  if (!m.ok()) return m.status();
  state->start_thread();
  lost_worker_hook().add(state);
  return std::shared_ptr<MembershipWatch>(new MembershipWatch(std::move(state)));
}

MembershipWatch::MembershipWatch(std::shared_ptr<State> state) : state_(std::move(state)) {}

MembershipWatch::~MembershipWatch() { state_->stop(); }

absl::StatusOr<rpc::Membership> MembershipWatch::current() { return state_->client().current(); }

absl::StatusOr<rpc::Membership> MembershipWatch::await_change(int64_t epoch,
                                                              absl::Duration timeout) {
  return state_->client().await_change(epoch, timeout);
}

absl::StatusOr<rpc::Membership> MembershipWatch::at_epoch(int64_t epoch) {
  return state_->client().at_epoch(epoch);
}

absl::StatusOr<rpc::Membership> MembershipWatch::remove(const std::string& worker) {
  return state_->client().remove(worker);
}

void MembershipWatch::report_lost(const std::string& worker) { state_->lost(worker); }

absl::StatusOr<rpc::Membership> MembershipWatch::request_join(const std::string& worker) {
  return state_->client().request_join(worker);
}

absl::StatusOr<rpc::Membership> MembershipWatch::admit_joining() {
  return state_->client().admit_joining();
}

std::vector<std::string> MembershipWatch::removals() { return state_->removals(); }

}  // namespace ddprpc::elastic
