// The pull pool: one pull per peer at a time, in order; a stalled peer
// holds none of the others; a delivery holds its thread but not its peer;
// threads stay within their bound and leave when idle; stop() drops what
// is queued.
#include "rpc/transport/internal/bulk_pull_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace ddprpc::rpc::transport::bulk {
namespace {

// Counts pulls running per peer, and the most that ever ran at once.
struct Tally {
  absl::Mutex mu;
  std::map<int, int> running ABSL_GUARDED_BY(mu);
  std::map<int, int> most ABSL_GUARDED_BY(mu);
  std::map<int, std::vector<int>> order ABSL_GUARDED_BY(mu);
  int delivered ABSL_GUARDED_BY(mu) = 0;

  std::function<void()> pull(int peer, int n) {
    return [this, peer, n] {
      {
        absl::MutexLock lock(&mu);
        most[peer] = std::max(most[peer], ++running[peer]);
        order[peer].push_back(n);
      }
      absl::SleepFor(absl::Milliseconds(2));
      absl::MutexLock lock(&mu);
      --running[peer];
    };
  }
  std::function<void()> deliver() {
    return [this] {
      absl::MutexLock lock(&mu);
      ++delivered;
    };
  }
  bool wait_delivered(int n) {
    absl::MutexLock lock(&mu);
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return delivered >= n; };
    return mu.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(20));
  }
};

TEST(PullPoolTest, OnePullPerPeerAtATimeInOrderAndPeersInParallel) {
  PullPool pool(PullPoolOptions{4, absl::Seconds(10), /*max_delivering=*/0});
  Tally tally;
  constexpr int kPeers = 3, kEach = 20;
  for (int n = 0; n < kEach; ++n) {
    for (int p = 0; p < kPeers; ++p) ASSERT_TRUE(pool.submit(p, tally.pull(p, n), tally.deliver()));
  }
  ASSERT_TRUE(tally.wait_delivered(kPeers * kEach));
  EXPECT_LE(pool.threads(), 4);
  absl::MutexLock lock(&tally.mu);
  for (int p = 0; p < kPeers; ++p) {
    EXPECT_EQ(tally.most[p], 1) << "peer " << p;
    std::vector<int> expected(kEach);
    for (int n = 0; n < kEach; ++n) expected[n] = n;
    EXPECT_EQ(tally.order[p], expected) << "peer " << p;
  }
}

TEST(PullPoolTest, AStalledPeerHoldsNoOtherPeer) {
  PullPool pool(PullPoolOptions{4, absl::Seconds(10)});
  absl::Notification release;
  std::atomic<int> stalled_done{0};
  ASSERT_TRUE(pool.submit(
      7, [&] { release.WaitForNotificationWithTimeout(absl::Seconds(20)); },
      [&] { ++stalled_done; }));
  Tally tally;
  for (int n = 0; n < 10; ++n) ASSERT_TRUE(pool.submit(1, tally.pull(1, n), tally.deliver()));
  EXPECT_TRUE(tally.wait_delivered(10));
  EXPECT_EQ(stalled_done.load(), 0);
  release.Notify();
  for (int i = 0; i < 2000 && stalled_done.load() == 0; ++i) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(stalled_done.load(), 1);
}

TEST(PullPoolTest, ABlockedDeliveryHoldsItsThreadButNotItsPeer) {
  PullPool pool(PullPoolOptions{2, absl::Seconds(10)});
  absl::Notification second_delivered;
  absl::Notification first_returned;
  // The first delivery of peer 3 waits for the second job of the same peer,
  // as a reply's callback may wait for another call's reply.
  ASSERT_TRUE(pool.submit(
      3, [] {},
      [&] {
        second_delivered.WaitForNotificationWithTimeout(absl::Seconds(20));
        first_returned.Notify();
      }));
  ASSERT_TRUE(pool.submit(3, [] {}, [&] { second_delivered.Notify(); }));
  EXPECT_TRUE(first_returned.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_TRUE(second_delivered.HasBeenNotified());
}

// Deliveries that block on calls whose replies wait here to be pulled
// (16 reply callbacks each making a call, say) do not take every thread:
// the pull they wait for still runs, on a thread beyond those that pull.
TEST(PullPoolTest, DeliveriesBlockedOnLaterPullsDoNotStarveThem) {
  PullPool pool(PullPoolOptions{2, absl::Seconds(10), /*max_delivering=*/4});
  absl::Notification last_pulled;
  std::atomic<int> returned{0};
  for (int p = 0; p < 2; ++p) {
    ASSERT_TRUE(pool.submit(
        p, [] {},
        [&] {
          last_pulled.WaitForNotificationWithTimeout(absl::Seconds(20));
          ++returned;
        }));
  }
  for (int i = 0; i < 400 && pool.threads() < 2; ++i) absl::SleepFor(absl::Milliseconds(5));
  absl::SleepFor(absl::Milliseconds(50));  // both deliveries are blocked now
  const absl::Time start = absl::Now();
  ASSERT_TRUE(pool.submit(9, [&] { last_pulled.Notify(); }, [] {}));
  EXPECT_TRUE(last_pulled.WaitForNotificationWithTimeout(absl::Seconds(5)))
      << "the pull that blocked deliveries wait for never ran";
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  for (int i = 0; i < 2000 && returned.load() < 2; ++i) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(returned.load(), 2);
  EXPECT_LE(pool.threads(), 2 + 4);
}

TEST(PullPoolTest, ThreadsStayWithinTheBoundAndLeaveWhenIdle) {
  PullPool pool(PullPoolOptions{3, absl::Milliseconds(50), /*max_delivering=*/0});
  Tally tally;
  for (int p = 0; p < 10; ++p) ASSERT_TRUE(pool.submit(p, tally.pull(p, 0), tally.deliver()));
  EXPECT_LE(pool.threads(), 3);
  ASSERT_TRUE(tally.wait_delivered(10));
  for (int i = 0; i < 400 && pool.threads() > 0; ++i) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(pool.threads(), 0);
  // And start again when work comes.
  ASSERT_TRUE(pool.submit(0, tally.pull(0, 1), tally.deliver()));
  EXPECT_TRUE(tally.wait_delivered(11));
}

TEST(PullPoolTest, StopDropsQueuedJobsAndRefusesNewOnes) {
  auto pool = std::make_unique<PullPool>(PullPoolOptions{1, absl::Seconds(10)});
  absl::Notification started, release;
  std::atomic<int> delivered{0};
  ASSERT_TRUE(pool->submit(
      0,
      [&] {
        started.Notify();
        release.WaitForNotificationWithTimeout(absl::Seconds(20));
      },
      [&] { ++delivered; }));
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(20)));
  // Queued behind the running one (same peer), and on another peer with no
  // free thread.
  auto dropped = std::make_shared<int>(0);
  std::weak_ptr<int> watch = dropped;
  ASSERT_TRUE(pool->submit(0, [dropped] {}, [&] { ++delivered; }));
  ASSERT_TRUE(pool->submit(1, [dropped] {}, [&] { ++delivered; }));
  dropped.reset();
  pool->stop();
  EXPECT_TRUE(watch.expired());  // the queued jobs were destroyed unrun
  EXPECT_FALSE(pool->submit(2, [] {}, [] {}));
  release.Notify();
  pool.reset();  // waits for the running job
  EXPECT_EQ(delivered.load(), 1);
}

}  // namespace
}  // namespace ddprpc::rpc::transport::bulk
