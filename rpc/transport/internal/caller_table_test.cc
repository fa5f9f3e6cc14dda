#include "rpc/transport/internal/caller_table.h"

#include <memory>

#include "gtest/gtest.h"

namespace ddprpc::rpc::internal {
namespace {

using Stream = std::shared_ptr<int>;

TEST(CallerTableTest, AWorkerAtItsLimitLosesItsOldestStream) {
  CallerTable<Stream> table(/*world_size=*/3, /*max_per_worker=*/2);
  Stream a = std::make_shared<int>(1), b = std::make_shared<int>(2), c = std::make_shared<int>(3);
  EXPECT_EQ(table.admit(1, a), nullptr);
  EXPECT_EQ(table.admit(1, b), nullptr);
  EXPECT_EQ(table.count(1), 2);
  EXPECT_EQ(table.admit(1, c), a);  // the oldest gives way
  EXPECT_EQ(table.count(1), 2);
  EXPECT_FALSE(table.release(1, a)) << "a stream that gave way is no longer counted";
  Stream d = std::make_shared<int>(4);
  EXPECT_EQ(table.admit(1, d), b);
  EXPECT_EQ(table.count(0), 0);
  EXPECT_EQ(table.count(2), 0);
}

TEST(CallerTableTest, ReleasedStreamsFreeTheirSlot) {
  CallerTable<Stream> table(2, 2);
  Stream a = std::make_shared<int>(1), b = std::make_shared<int>(2), c = std::make_shared<int>(3);
  table.admit(0, a);
  table.admit(0, b);
  EXPECT_TRUE(table.release(0, a));
  EXPECT_FALSE(table.release(0, a));
  EXPECT_EQ(table.count(0), 1);
  EXPECT_EQ(table.admit(0, c), nullptr) << "a freed slot takes the next stream without replacing";
  EXPECT_EQ(table.admit(0, std::make_shared<int>(4)), b);
}

TEST(CallerTableTest, WorkersAreCountedApartAndReleaseIgnoresUnknownWorkers) {
  CallerTable<Stream> table(2, 1);
  Stream a = std::make_shared<int>(1), b = std::make_shared<int>(2);
  EXPECT_EQ(table.admit(0, a), nullptr);
  EXPECT_EQ(table.admit(1, b), nullptr);
  EXPECT_FALSE(table.release(1, a)) << "a is counted for worker 0";
  EXPECT_FALSE(table.release(-1, a));
  EXPECT_FALSE(table.release(2, a));
  EXPECT_EQ(table.count(0), 1);
  EXPECT_EQ(table.count(1), 1);
}

TEST(CallerTableTest, ALimitBelowOneStillAdmitsOneStream) {
  CallerTable<Stream> table(1, 0);
  Stream a = std::make_shared<int>(1), b = std::make_shared<int>(2);
  EXPECT_EQ(table.admit(0, a), nullptr);
  EXPECT_EQ(table.admit(0, b), a);
  EXPECT_EQ(table.count(0), 1);
}

}  // namespace
}  // namespace ddprpc::rpc::internal
