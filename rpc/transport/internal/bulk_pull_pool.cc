#include "rpc/transport/internal/bulk_pull_pool.h"

#include <algorithm>
#include <exception>
#include <set>
#include <system_error>
#include <utility>

#include "glog/logging.h"

namespace ddprpc::rpc::transport::bulk {
namespace {

struct Job {
  std::function<void()> pull;
  std::function<void()> deliver;
};

void call(const std::function<void()>& f, const char* what) {
  try {
    f();
  } catch (const std::exception& e) {
    LOG(ERROR) << "bulk path: a " << what << " threw: " << e.what();
  } catch (...) {
    LOG(ERROR) << "bulk path: a " << what << " threw";
  }
}

}  // namespace

struct PullPool::Core {
  explicit Core(PullPoolOptions o) : options(o) {}
  const PullPoolOptions options;
  mutable absl::Mutex mu;
  // State below is protected by mu.
  std::map<int, std::deque<Job>> queued ABSL_GUARDED_BY(mu);
  // Peers whose pull runs now.
  std::set<int> pulling ABSL_GUARDED_BY(mu);
  // Peers with queued jobs and no pull running, in the order they get a
  // turn: a peer is here exactly when it has queued jobs and is not in
  // `pulling`.
  std::deque<int> turns ABSL_GUARDED_BY(mu);
  int threads ABSL_GUARDED_BY(mu) = 0;  // started and not yet left
  int idle ABSL_GUARDED_BY(mu) = 0;     // of them, waiting for a turn
  int delivering ABSL_GUARDED_BY(mu) = 0;  // of them, in a delivery
  std::vector<std::thread::id> ids ABSL_GUARDED_BY(mu);
  bool stopped ABSL_GUARDED_BY(mu) = false;

  // Starts a thread when more peers wait for a turn than threads wait for
  // a peer. False when none could start and none runs.
  bool add_thread_if_needed(const std::shared_ptr<Core>& self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (stopped || static_cast<int>(turns.size()) <= idle ||
        threads - delivering >= options.max_threads ||
        threads >= options.max_threads + options.max_delivering) {
      return true;
    }
    ++threads;
    try {
      std::thread(&PullPool::run, self).detach();
    } catch (const std::system_error& e) {
      --threads;
      LOG(WARNING) << "bulk path: cannot start a pull thread: " << e.what();
      return threads > 0;
    }
    return true;
  }
};

PullPool::PullPool(PullPoolOptions options)
    : core_(std::make_shared<Core>(options)) {}

PullPool::~PullPool() {
  stop();
  wait();
}

void PullPool::wait() {
  const std::thread::id me = std::this_thread::get_id();
  absl::MutexLock lock(&core_->mu);
  auto gone = [this, me]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    const auto& ids = core_->ids;
    return core_->threads == 0 ||
           (core_->threads == 1 && std::find(ids.begin(), ids.end(), me) != ids.end());
  };
  core_->mu.Await(absl::Condition(&gone));
}

bool PullPool::submit(int peer, std::function<void()> pull, std::function<void()> deliver) {
  absl::MutexLock lock(&core_->mu);
  if (core_->stopped) return false;
  std::deque<Job>& queue = core_->queued[peer];
  const bool first = queue.empty();
  queue.push_back(Job{std::move(pull), std::move(deliver)});
  if (first && core_->pulling.count(peer) == 0) core_->turns.push_back(peer);
  if (!core_->add_thread_if_needed(core_)) {
    // No thread runs it: take it back.
    queue.pop_back();
    if (queue.empty()) {
      core_->queued.erase(peer);
      auto it = std::find(core_->turns.begin(), core_->turns.end(), peer);
      if (it != core_->turns.end()) core_->turns.erase(it);
    }
    return false;
  }
  return true;
}

void PullPool::stop() {
  std::map<int, std::deque<Job>> dropped;
  {
    absl::MutexLock lock(&core_->mu);
    core_->stopped = true;
    dropped.swap(core_->queued);
    core_->turns.clear();
  }
  // Destroyed here, without the mutex: their captures may be the last
  // references to frames, responders and channels.
}

int PullPool::threads() const {
  absl::MutexLock lock(&core_->mu);
  return core_->threads;
}

void PullPool::run(std::shared_ptr<Core> core) {
  absl::Mutex& mu = core->mu;
  mu.Lock();
  core->ids.push_back(std::this_thread::get_id());
  auto ready = [&core]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(core->mu) {
    return core->stopped || !core->turns.empty();
  };
  for (;;) {
    ++core->idle;
    const bool woke = mu.AwaitWithTimeout(absl::Condition(&ready), core->options.idle_timeout);
    --core->idle;
    if (core->stopped || !woke) break;
    const int peer = core->turns.front();
    core->turns.pop_front();
    auto it = core->queued.find(peer);
    Job job = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) core->queued.erase(it);
    core->pulling.insert(peer);
    core->add_thread_if_needed(core);
    mu.Unlock();

    call(job.pull, "pull");

    mu.Lock();
    core->pulling.erase(peer);
    if (core->queued.count(peer) != 0) core->turns.push_back(peer);
    // While this thread delivers (perhaps blocking), another may pull.
    ++core->delivering;
    core->add_thread_if_needed(core);
    mu.Unlock();

    call(job.deliver, "delivery");
    job = Job{};  // its captures go without the mutex held

    mu.Lock();
    --core->delivering;
  }
  core->ids.erase(std::find(core->ids.begin(), core->ids.end(), std::this_thread::get_id()));
  --core->threads;
  mu.Unlock();
}

}  // namespace ddprpc::rpc::transport::bulk
