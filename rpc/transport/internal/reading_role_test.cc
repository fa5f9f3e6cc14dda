#include "rpc/transport/internal/reading_role.h"

#include <atomic>
#include <set>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace ddprpc::rpc::internal {
namespace {

// A server stand-in: its holder stays in hold() until it loses the role or
// the role stops; one that lost it stays on its "message" until another
// thread holds the role, as a request that blocks would.
struct Server {
  absl::Mutex mu;
  int holding ABSL_GUARDED_BY(mu) = 0;  // threads inside hold() now
  // A thread entered hold() without holding the role.
  bool entered_without_role ABSL_GUARDED_BY(mu) = false;
  std::set<int64_t> holders ABSL_GUARDED_BY(mu);
  int turns ABSL_GUARDED_BY(mu) = 0;  // times a thread took the role
  int64_t current ABSL_GUARDED_BY(mu) = ReadingRole::kNobody;
  bool throw_next ABSL_GUARDED_BY(mu) = false;
  ReadingRole role;

  explicit Server(int max_idle)
      : role(&mu, {"test", false, max_idle}, [this](int64_t me) { hold(me); }) {}

  void hold(int64_t me) {
    absl::MutexLock lock(&mu);
    if (!role.held_by(me)) entered_without_role = true;
    ++holding;
    ++turns;
    holders.insert(me);
    current = me;
    if (throw_next) {
      throw_next = false;
      --holding;
      throw std::runtime_error("a hold that throws");
    }
    auto lost = [this, me]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return !role.held_by(me) || role.stopped();
    };
    mu.Await(absl::Condition(&lost));
    auto taken = [this, me]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return current != me || role.stopped();
    };
    mu.Await(absl::Condition(&taken));
    --holding;
  }

  // Waits until a thread other than `than` holds the role.
  int64_t await_holder_other_than(int64_t than) {
    absl::MutexLock lock(&mu);
    auto changed = [this, than]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return current != than && current != ReadingRole::kNobody && role.held_by(current);
    };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&changed), absl::Seconds(10)));
    return current;
  }
};

TEST(ReadingRoleTest, OneThreadHoldsTheRoleAndAHandOffGivesItToAnother) {
  Server s(/*max_idle=*/-1);
  {
    absl::MutexLock lock(&s.mu);
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(s.role.add_thread());
    EXPECT_EQ(s.role.threads(), 3);
  }
  int64_t first = s.await_holder_other_than(ReadingRole::kNobody);
  for (int i = 0; i < 5; ++i) {
    {
      absl::MutexLock lock(&s.mu);
      // The others wait for the role (the last holder is back among them).
      auto others_wait = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
        return s.role.busy_threads() == 1;
      };
      ASSERT_TRUE(s.mu.AwaitWithTimeout(absl::Condition(&others_wait), absl::Seconds(10)));
      s.role.hand_off();
      EXPECT_FALSE(s.role.held_by(first));
    }
    first = s.await_holder_other_than(first);
  }
  {
    absl::MutexLock lock(&s.mu);
    EXPECT_FALSE(s.entered_without_role);
    EXPECT_GE(s.holders.size(), 2u);
    EXPECT_EQ(s.role.threads(), 3) << "threads were waiting: none should have started";
    s.role.stop();
  }
  s.role.join();
  absl::MutexLock lock(&s.mu);
  EXPECT_EQ(s.role.threads(), 0);
}

TEST(ReadingRoleTest, AHandOffWithNoThreadWaitingStartsOne) {
  Server s(/*max_idle=*/-1);
  {
    absl::MutexLock lock(&s.mu);
    ASSERT_TRUE(s.role.add_thread());
  }
  const int64_t first = s.await_holder_other_than(ReadingRole::kNobody);
  {
    absl::MutexLock lock(&s.mu);
    s.role.hand_off();
    EXPECT_EQ(s.role.threads(), 2);
  }
  EXPECT_NE(s.await_holder_other_than(first), first);
  {
    absl::MutexLock lock(&s.mu);
    s.role.stop();
    EXPECT_FALSE(s.role.add_thread()) << "no thread starts after stop()";
  }
  s.role.join();
}

TEST(ReadingRoleTest, ThreadsBeyondMaxIdleLeaveAndAreJoined) {
  Server s(/*max_idle=*/0);
  {
    absl::MutexLock lock(&s.mu);
    ASSERT_TRUE(s.role.add_thread());
  }
  int64_t holder = s.await_holder_other_than(ReadingRole::kNobody);
  // Each hand-off starts a thread (none waits); the one that lost the role
  // leaves instead of waiting.
  for (int i = 0; i < 20; ++i) {
    {
      absl::MutexLock lock(&s.mu);
      s.role.hand_off();
    }
    holder = s.await_holder_other_than(holder);
  }
  {
    absl::MutexLock lock(&s.mu);
    auto one_left = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return s.role.threads() == 1; };
    EXPECT_TRUE(s.mu.AwaitWithTimeout(absl::Condition(&one_left), absl::Seconds(10)))
        << s.role.threads() << " threads run";
    s.role.stop();
  }
  s.role.join();
}

TEST(ReadingRoleTest, AHoldThatThrowsFreesTheRoleAndTheThreadGoesOn) {
  Server s(/*max_idle=*/-1);
  {
    absl::MutexLock lock(&s.mu);
    s.throw_next = true;
    ASSERT_TRUE(s.role.add_thread());
  }
  // The thread's first hold throws; it takes the role again.
  {
    absl::MutexLock lock(&s.mu);
    auto twice = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
      return !s.throw_next && s.holding == 1;
    };
    EXPECT_TRUE(s.mu.AwaitWithTimeout(absl::Condition(&twice), absl::Seconds(10)));
    EXPECT_EQ(s.role.threads(), 1);
    s.role.stop();
  }
  s.role.join();
}

// The two together, as a server uses them: the watchdog hands the role on
// from a holder that has been on one message too long, and a holder that
// stays stuck for good does not stop the others from taking turns.
TEST(ReadingRoleTest, TheWatchdogTakesTheRoleFromAHolderStuckOnAMessage) {
  Server s(/*max_idle=*/2);
  absl::Time since ABSL_GUARDED_BY(s.mu) = absl::InfiniteFuture();  // the holder's message
  int64_t busy ABSL_GUARDED_BY(s.mu) = ReadingRole::kNobody;
  int hand_offs = 0;
  RoleWatchdog dog(&s.mu, absl::ZeroDuration(), [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
    if (busy != s.current || busy == ReadingRole::kNobody) {
      busy = s.current;
      since = absl::Now();
    }
    if (busy != ReadingRole::kNobody && absl::Now() - since >= absl::Milliseconds(20)) {
      s.role.hand_off();
      ++hand_offs;
      busy = ReadingRole::kNobody;
    }
    return absl::Milliseconds(5);
  });
  {
    absl::MutexLock lock(&s.mu);
    ASSERT_TRUE(s.role.add_thread());
  }
  dog.start(false);
  {
    absl::MutexLock lock(&s.mu);
    // Every holder stays on its message until it loses the role (and until
    // another holds it): only the watchdog moves the role on.
    auto turns = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return s.turns >= 6; };
    EXPECT_TRUE(s.mu.AwaitWithTimeout(absl::Condition(&turns), absl::Seconds(20)))
        << s.turns << " turns, " << hand_offs << " hand-offs";
    EXPECT_GE(hand_offs, 5);
    // The thread that lost the role waits for it (max_idle 2) and takes it
    // at the next hand-off: two threads take turns.
    EXPECT_GE(s.holders.size(), 2u);
    EXPECT_FALSE(s.entered_without_role);
    EXPECT_LE(s.role.threads(), 4) << "threads that lost the role wait (2 at most) or leave";
    s.role.stop();
  }
  dog.stop();
  s.role.join();
  absl::MutexLock lock(&s.mu);
  EXPECT_EQ(s.role.threads(), 0);
}

TEST(RoleWatchdogTest, ALookOfZeroStillLetsTheMutexGo) {
  absl::Mutex mu;
  int looks ABSL_GUARDED_BY(mu) = 0;
  RoleWatchdog dog(&mu, absl::ZeroDuration(), [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ++looks;
    return absl::ZeroDuration();
  });
  dog.start(false);
  {
    absl::MutexLock lock(&mu);
    auto looked = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return looks >= 3; };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&looked), absl::Seconds(10)));
  }
  // Each look waits kMinWait with the mutex let go: this thread gets it.
  for (int i = 0; i < 20; ++i) {
    const absl::Time start = absl::Now();
    {
      absl::MutexLock lock(&mu);
    }
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));
  }
  dog.stop();
}

TEST(RoleWatchdogTest, ParksUntilWokenAndStopsWhileParked) {
  absl::Mutex mu;
  int looks = 0;
  bool work = false;
  RoleWatchdog dog(&mu, absl::ZeroDuration(), [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ++looks;
    if (!work) return absl::InfiniteDuration();
    work = false;
    return absl::Milliseconds(1);
  });
  dog.start(false);
  auto looked = [&](int n) {
    absl::MutexLock lock(&mu);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return looks >= n; };
    return mu.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
  };
  ASSERT_TRUE(looked(1));
  absl::SleepFor(absl::Milliseconds(50));
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(looks, 1) << "a watchdog with nothing to look at parks";
    work = true;
  }
  dog.wake();
  // Woken: one look finds the work, the next (1 ms later) finds none.
  ASSERT_TRUE(looked(3));
  absl::SleepFor(absl::Milliseconds(50));
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(looks, 3);
  }
  dog.stop();  // parked: returns anyway
}

TEST(RoleWatchdogTest, AWakeDuringALookThatDecidedToParkKeepsItAwake) {
  // The first look decides there is nothing to do, then releases the mutex
  // for a while (as the gRPC server's look does), during which work is
  // marked and the watchdog woken: it must look again, not park.
  absl::Mutex mu;
  int looks = 0;
  int marks = 0;
  int seen = 0;
  RoleWatchdog* dog_ptr = nullptr;
  RoleWatchdog dog(&mu, absl::ZeroDuration(), [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ++looks;
    const bool idle = seen == marks;
    if (looks == 1) {
      mu.Unlock();
      {
        absl::MutexLock lock(&mu);
        ++marks;
      }
      dog_ptr->wake();
      mu.Lock();
    }
    if (idle) return absl::InfiniteDuration();
    seen = marks;
    return absl::Milliseconds(1);
  });
  dog_ptr = &dog;
  dog.start(false);
  {
    absl::MutexLock lock(&mu);
    auto caught_up = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return seen == 1; };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&caught_up), absl::Seconds(10)))
        << "the mark made during the first look was never looked at";
  }
  dog.stop();
}

}  // namespace
}  // namespace ddprpc::rpc::internal
