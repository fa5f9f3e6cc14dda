// ThreadPool: every task runs once, in order per thread count one; bounded
// queueing; a throwing task does not take its thread down. Also run under
// --config=tsan.
#include "rpc/core/internal/thread_pool.h"

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace ddprpc::rpc::internal {
namespace {

TEST(ThreadPoolTest, RunsEveryTaskFromManyProducers) {
  std::atomic<int> ran{0};
  {
    ThreadPool pool(4);
    std::vector<std::thread> producers;
    for (int p = 0; p < 4; ++p) {
      producers.emplace_back([&] {
        for (int i = 0; i < 1000; ++i) pool.run([&] { ++ran; });
      });
    }
    for (auto& t : producers) t.join();
  }  // runs what is queued, then joins
  EXPECT_EQ(ran.load(), 4000);
}

TEST(ThreadPoolTest, OneThreadRunsTasksInOrder) {
  std::vector<int> order;
  {
    ThreadPool pool(1);
    for (int i = 0; i < 100; ++i) pool.run([&order, i] { order.push_back(i); });
  }
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST(ThreadPoolTest, TryRunRefusesPastTheBound) {
  ThreadPool pool(1);
  std::atomic<bool> started{false}, release{false};
  pool.run([&] {
    started = true;
    while (!release) std::this_thread::yield();
  });
  while (!started) std::this_thread::yield();
  EXPECT_TRUE(pool.try_run([] {}, 2));
  EXPECT_TRUE(pool.try_run([] {}, 2));
  EXPECT_FALSE(pool.try_run([] {}, 2));  // two wait already
  release = true;
}

TEST(ThreadPoolTest, AThrowingTaskDoesNotStopItsThread) {
  std::atomic<int> ran{0};
  {
    ThreadPool pool(1);
    pool.run([] { throw std::runtime_error("task failed"); });
    pool.run([&] { ++ran; });
  }
  EXPECT_EQ(ran.load(), 1);
}

}  // namespace
}  // namespace ddprpc::rpc::internal
