#include "rpc/transport/internal/spin_poll.h"

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "gtest/gtest.h"

namespace ddprpc::rpc::transport {
namespace {

class SpinPollTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds_), 0);
  }
  void TearDown() override {
    close(fds_[0]);
    close(fds_[1]);
  }
  int poll_once(SpinPoll& spin, int timeout_ms) {
    pollfd p{fds_[0], POLLIN, 0};
    const int r = spin.poll(&p, 1, timeout_ms);
    if (r > 0) {
      EXPECT_TRUE(p.revents & POLLIN);
      char c;
      EXPECT_EQ(read(fds_[0], &c, 1), 1);
    }
    return r;
  }
  int fds_[2];
};

TEST_F(SpinPollTest, BytesThatComeWhileSpinningKeepTheFullBudget) {
  SpinPoll spin(/*max_ns=*/100'000'000);
  std::thread writer([this] {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    ASSERT_EQ(write(fds_[1], "x", 1), 1);
  });
  EXPECT_EQ(poll_once(spin, 1000), 1);
  writer.join();
  EXPECT_EQ(spin.budget_ns(), 100'000'000);
}

TEST_F(SpinPollTest, WaitsLongerThanTheBudgetHalveItUntilNoneThenProbe) {
  SpinPoll spin(/*max_ns=*/64'000);
  EXPECT_EQ(poll_once(spin, 1), 0);  // spins 64 us, then sleeps 1 ms: nothing came
  EXPECT_EQ(spin.budget_ns(), 32'000);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(poll_once(spin, 1), 0);
  EXPECT_EQ(spin.budget_ns(), 1'000);  // under the minimum: no more spinning
  for (int i = 1; i < SpinPoll::kProbeEvery; ++i) {
    EXPECT_EQ(poll_once(spin, 1), 0);
    EXPECT_EQ(spin.budget_ns(), 1'000);
  }
  // The kProbeEvery-th wait without budget spins in full once more; bytes
  // already there end it at once and restore the budget.
  ASSERT_EQ(write(fds_[1], "x", 1), 1);
  EXPECT_EQ(poll_once(spin, 1), 1);
  EXPECT_EQ(spin.budget_ns(), 64'000);
}

TEST_F(SpinPollTest, AFailedProbeLeavesNoBudget) {
  SpinPoll spin(/*max_ns=*/4'000);
  EXPECT_EQ(poll_once(spin, 1), 0);
  EXPECT_EQ(poll_once(spin, 1), 0);
  EXPECT_EQ(spin.budget_ns(), 1'000);
  for (int i = 0; i < SpinPoll::kProbeEvery; ++i) EXPECT_EQ(poll_once(spin, 1), 0);
  EXPECT_EQ(spin.budget_ns(), 0);
}

TEST_F(SpinPollTest, NoTimeoutAndNoMaximumNeverSpin) {
  SpinPoll off(/*max_ns=*/0);
  EXPECT_EQ(poll_once(off, 1), 0);
  EXPECT_EQ(off.budget_ns(), 0);
  SpinPoll on(/*max_ns=*/64'000);
  EXPECT_EQ(poll_once(on, 0), 0);
  EXPECT_EQ(on.budget_ns(), 64'000);
  ASSERT_EQ(write(fds_[1], "x", 1), 1);
  EXPECT_EQ(poll_once(off, 1000), 1);
}

TEST_F(SpinPollTest, EachThreadFollowsTheMaximumItIsGiven) {
  SpinPoll& spin = SpinPoll::this_thread(64'000);
  EXPECT_EQ(poll_once(spin, 1), 0);
  EXPECT_EQ(spin.budget_ns(), 32'000);
  EXPECT_EQ(&SpinPoll::this_thread(64'000), &spin);
  EXPECT_EQ(spin.budget_ns(), 32'000);  // the same maximum keeps what it learnt
  EXPECT_EQ(SpinPoll::this_thread(0).budget_ns(), 0);
  EXPECT_EQ(poll_once(SpinPoll::this_thread(0), 1), 0);
  EXPECT_EQ(SpinPoll::this_thread(0).budget_ns(), 0);  // no spin, so no miss either
  int64_t other = -1;
  std::thread([&] { other = SpinPoll::this_thread(128'000).budget_ns(); }).join();
  EXPECT_EQ(other, 128'000);
  EXPECT_EQ(SpinPoll::this_thread(64'000).budget_ns(), 64'000);
}

TEST(SpinTest, ALookThatSucceedsKeepsTheBudgetALongWaitAfterOneThatDidNotHalvesIt) {
  SpinPoll spin(/*max_ns=*/64'000);
  int looks = 0;
  EXPECT_TRUE(spin.spin([&] { return ++looks == 3; }));
  EXPECT_EQ(looks, 3);
  EXPECT_EQ(spin.budget_ns(), 64'000);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(spin.spin([] { return false; }));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::microseconds(64));
  std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the caller's own wait
  spin.slept();
  EXPECT_EQ(spin.budget_ns(), 32'000);
}

// A wait that ends soon after the allowance ran out (within twice the
// maximum) fills it again, even from none: two threads of an exchange that
// both stopped looking start again.
TEST(SpinTest, AWaitThatEndsSoonAfterFillsTheBudgetAgain) {
  SpinPoll spin(/*max_ns=*/5'000'000);
  EXPECT_FALSE(spin.spin([] { return false; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // 4x the maximum
  spin.slept();
  EXPECT_EQ(spin.budget_ns(), 2'500'000);
  EXPECT_FALSE(spin.spin([] { return false; }));
  spin.slept();  // at once: within twice the maximum
  EXPECT_EQ(spin.budget_ns(), 5'000'000);
  // Down to none with long waits; then one short wait, without a spin.
  while (spin.budget_ns() >= 2'000) {
    EXPECT_FALSE(spin.spin([] { return false; }));
    std::this_thread::sleep_for(std::chrono::milliseconds(11));
    spin.slept();
  }
  int looks = 0;
  EXPECT_FALSE(spin.spin([&] { return ++looks > 0; }));
  EXPECT_EQ(looks, 0);  // no allowance: no look
  spin.slept();
  EXPECT_EQ(spin.budget_ns(), 5'000'000);
}

TEST(SpinTest, NoMaximumNeverLooks) {
  SpinPoll spin(/*max_ns=*/0);
  int looks = 0;
  for (int i = 0; i < 3 * SpinPoll::kProbeEvery; ++i) {
    EXPECT_FALSE(spin.spin([&] { return ++looks > 0; }));
    spin.slept();
  }
  EXPECT_EQ(looks, 0);
  EXPECT_EQ(spin.budget_ns(), 0);
}

}  // namespace
}  // namespace ddprpc::rpc::transport
