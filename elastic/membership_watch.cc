#include "elastic/membership_watch.h"

#include <deque>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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
  void lost(const std::string& worker) {
    absl::MutexLock lock(&mu_);
    // At most one entry per worker of the job, and none for a worker this
    // watch removed already: the queue stays bounded.
    if (removed_.count(worker) > 0 || worker == removing_now_) return;
    for (const std::string& w : queue_) {
      if (w == worker) return;
    }
    if (queue_.size() < rpc::Membership::kMaxWorkers) queue_.push_back(worker);
  }

  std::vector<std::string> removals() {
    absl::MutexLock lock(&mu_);
    return done_;
  }

 private:
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
        if (removed_.size() < rpc::Membership::kMaxWorkers) removed_.insert(worker);
        LOG(WARNING) << "membership: worker '" << worker << "' is out; epoch " << m->epoch;
      } else {
        LOG(WARNING) << "membership: could not remove worker '" << worker
                     << "': " << m.status().message();
        outcome = absl::StrCat(worker, " (", m.status().message(), ")");
      }
      // Bounded: failed removals may come back.
      if (done_.size() < 4 * rpc::Membership::kMaxWorkers) done_.push_back(std::move(outcome));
    }
  }

  const std::shared_ptr<rpc::Store> store_;
  const rpc::MembershipClient::Options options_;
  rpc::MembershipClient removing_;  // the thread's own
  std::thread thread_;

  absl::Mutex mu_;
  // State below is protected by mu_.
  std::deque<std::string> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> done_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> removed_ ABSL_GUARDED_BY(mu_);
  std::string removing_now_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

namespace {

class LostWorkerHook final : public rpc::RpcHook {
 public:
  explicit LostWorkerHook(std::weak_ptr<MembershipWatch::State> state) : state_(std::move(state)) {}
  void worker_unreachable(const rpc::WorkerInfo& worker, const std::string&) override {
    if (auto state = state_.lock()) state->lost(worker.name);
  }

 private:
  const std::weak_ptr<MembershipWatch::State> state_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<MembershipWatch>> MembershipWatch::start(
    std::shared_ptr<rpc::Store> store, std::vector<std::string> members,
    rpc::MembershipClient::Options options) {
  auto state = std::make_shared<State>(std::move(store), options);
  absl::StatusOr<rpc::Membership> m = state->client().start(std::move(members));
  if (!m.ok()) return m.status();
  state->start_thread();
  rpc::add_rpc_hook(std::make_shared<LostWorkerHook>(state));
  return std::shared_ptr<MembershipWatch>(new MembershipWatch(std::move(state)));
}

MembershipWatch::MembershipWatch(std::shared_ptr<State> state) : state_(std::move(state)) {}

MembershipWatch::~MembershipWatch() { state_->stop(); }

absl::StatusOr<rpc::Membership> MembershipWatch::current() { return state_->client().current(); }

absl::StatusOr<rpc::Membership> MembershipWatch::await_change(int64_t epoch,
                                                              absl::Duration timeout) {
  return state_->client().await_change(epoch, timeout);
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
