// The claims a receiver makes for pushed tensors: ranges land only in a
// claim of their own worker that expects them, once each; a claim whose
// ranges do not come in time, or go wrong, is taken over for a pull only
// after no range is being read into it; bounds per peer hold.
#include "rpc/transport/internal/bulk_claims.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "absl/synchronization/notification.h"
#include "rpc/transport/internal/bulk_wire.h"

namespace ddprpc::rpc::transport::bulk {
namespace {

struct Range {
  std::shared_ptr<ClaimTable::Claim> claim;
  char* dst = nullptr;
  uint64_t length = 0;
};

// A claim made as a checked frame makes it: reserved, then given its tensor.
std::shared_ptr<ClaimTable::Claim> add(ClaimTable* table, int peer, uint64_t id,
                                       at::Tensor tensor, uint32_t ranges) {
  auto claim = table->reserve(peer, id, tensor.nbytes(), ranges);
  if (claim == nullptr || !table->ready(claim, std::move(tensor))) return nullptr;
  return claim;
}

absl::Status begin(ClaimTable* table, int peer, uint64_t id, uint64_t total, uint32_t ranges,
                   uint32_t index, Range* out, absl::Duration wait = absl::Milliseconds(10)) {
  return table->begin_range(peer, id, total, ranges, index, wait, &out->claim, &out->dst,
                            &out->length);
}

TEST(BulkClaimsTest, RangesLandInTheirClaimAndCompleteIt) {
  ClaimTable table;
  const at::Tensor source = at::arange((1 << 18) + 3, at::kInt);  // not a multiple of the ranges
  const uint64_t total = source.nbytes();
  auto claim = add(&table, 1, 7, at::zeros({source.numel()}, at::kInt), 3);
  ASSERT_NE(claim, nullptr);
  for (uint32_t index : {2u, 0u, 1u}) {
    Range r;
    ASSERT_TRUE(begin(&table, 1, 7, total, 3, index, &r).ok());
    uint64_t offset, length;
    range_of(total, 3, index, &offset, &length);
    ASSERT_EQ(r.length, length);
    std::memcpy(r.dst, static_cast<const char*>(source.data_ptr()) + offset, length);
    table.end_range(r.claim, true);
  }
  EXPECT_TRUE(table.await(claim, absl::Seconds(1), absl::Now() + absl::Seconds(5)));
  EXPECT_TRUE(at::equal(claim->tensor, source));
  EXPECT_EQ(table.size(), 0u);
}

TEST(BulkClaimsTest, RangesForAnotherWorkerOrAnUnknownTensorFindNoClaim) {
  ClaimTable table;
  auto claim = add(&table, 1, 7, at::zeros({1024}, at::kByte), 1);
  ASSERT_NE(claim, nullptr);
  Range r;
  EXPECT_EQ(begin(&table, 2, 7, 1024, 1, 0, &r).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(begin(&table, 1, 8, 1024, 1, 0, &r).code(), absl::StatusCode::kNotFound);
  // The claim is untouched: its own range still lands.
  ASSERT_TRUE(begin(&table, 1, 7, 1024, 1, 0, &r).ok());
  table.end_range(r.claim, true);
  EXPECT_TRUE(table.await(claim, absl::Seconds(1), absl::Now() + absl::Seconds(5)));
}

TEST(BulkClaimsTest, ARangeThatDoesNotMatchItsClaimFailsItAtOnce) {
  struct Case {
    const char* what;
    uint64_t total;
    uint32_t ranges, index;
  };
  for (const Case& c : {Case{"another size", 4096, 2, 0}, Case{"other ranges", 8192, 3, 0},
                        Case{"a range past the last", 8192, 2, 2}}) {
    SCOPED_TRACE(c.what);
    ClaimTable table;
    auto claim = add(&table, 1, 7, at::zeros({8192}, at::kByte), 2);
    ASSERT_NE(claim, nullptr);
    Range r;
    EXPECT_EQ(begin(&table, 1, 7, c.total, c.ranges, c.index, &r).code(),
              absl::StatusCode::kDataLoss);
    const absl::Time start = absl::Now();
    EXPECT_FALSE(table.await(claim, absl::Seconds(30), absl::Now() + absl::Seconds(30)));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // not after the start wait
  }
  ClaimTable table;
  auto claim = add(&table, 1, 7, at::zeros({8192}, at::kByte), 2);
  Range first, again;
  ASSERT_TRUE(begin(&table, 1, 7, 8192, 2, 1, &first).ok());
  EXPECT_EQ(begin(&table, 1, 7, 8192, 2, 1, &again).code(), absl::StatusCode::kDataLoss)
      << "a range that came twice";
  table.end_range(first.claim, true);
  EXPECT_FALSE(table.await(claim, absl::Seconds(30), absl::Now() + absl::Seconds(30)));
}

TEST(BulkClaimsTest, AClaimWhoseRangesDoNotStartIsTakenOverOnlyOnceNoneIsBeingRead) {
  ClaimTable table;
  auto claim = add(&table, 1, 7, at::zeros({8192}, at::kByte), 2);
  Range r;
  ASSERT_TRUE(begin(&table, 1, 7, 8192, 2, 0, &r).ok());  // range 1 never comes
  absl::Notification taken;
  std::thread delivery([&] {
    EXPECT_FALSE(table.await(claim, absl::Milliseconds(50), absl::Now() + absl::Seconds(30)));
    taken.Notify();
  });
  // Range 0 is still being read: the delivery may not pull into the tensor.
  EXPECT_FALSE(taken.WaitForNotificationWithTimeout(absl::Milliseconds(300)));
  table.end_range(r.claim, true);
  EXPECT_TRUE(taken.WaitForNotificationWithTimeout(absl::Seconds(5)));
  delivery.join();
  // Taken over: a late range finds no claim.
  Range late;
  EXPECT_FALSE(begin(&table, 1, 7, 8192, 2, 1, &late).ok());
  EXPECT_EQ(table.size(), 0u);
}

TEST(BulkClaimsTest, ClaimsPerPeerAreBoundedInCountAndBytes) {
  ClaimTable table(ClaimLimits{3, 10000});
  std::vector<std::shared_ptr<ClaimTable::Claim>> held;
  for (uint64_t id = 1; id <= 3; ++id) {
    held.push_back(add(&table, 1, id, at::zeros({100}, at::kByte), 1));
    ASSERT_NE(held.back(), nullptr);
  }
  EXPECT_EQ(add(&table, 1, 4, at::zeros({100}, at::kByte), 1), nullptr) << "past the count";
  EXPECT_EQ(add(&table, 1, 2, at::zeros({100}, at::kByte), 1), nullptr) << "an id held";
  EXPECT_NE(add(&table, 2, 4, at::zeros({9000}, at::kByte), 1), nullptr) << "another peer";
  EXPECT_EQ(add(&table, 2, 5, at::zeros({1001}, at::kByte), 1), nullptr) << "past the bytes";
  EXPECT_EQ(add(&table, 3, 1, at::zeros({100}, at::kByte), kMaxPushRanges + 1), nullptr);
  table.drop(held[0]);
  EXPECT_NE(add(&table, 1, 4, at::zeros({100}, at::kByte), 1), nullptr) << "a dropped claim";
}

TEST(BulkClaimsTest, AReservationCountsBeforeItsTensorExistsAndTakesRangesOnceReady) {
  ClaimTable table(ClaimLimits{4, 1000});
  auto first = table.reserve(1, 7, 600, 1);
  ASSERT_NE(first, nullptr);
  // Refused before anything would be allocated for them.
  EXPECT_EQ(table.reserve(1, 8, 600, 1), nullptr) << "past the bytes";
  EXPECT_EQ(table.reserve(1, 7, 10, 1), nullptr) << "an id reserved";
  // A range for a claim without its tensor waits, then finds none.
  Range early;
  EXPECT_EQ(begin(&table, 1, 7, 600, 1, 0, &early, absl::Milliseconds(50)).code(),
            absl::StatusCode::kNotFound);
  // A tensor of other bytes than reserved ends the reservation.
  EXPECT_FALSE(table.ready(first, at::zeros({599}, at::kByte)));
  EXPECT_EQ(table.size(), 0u);
  auto second = table.reserve(1, 8, 600, 1);
  ASSERT_NE(second, nullptr) << "the ended reservation's bytes are free again";
  // A range waiting for the claim lands once it is ready.
  Range r;
  absl::Status begun;
  std::thread push([&] { begun = begin(&table, 1, 8, 600, 1, 0, &r, absl::Seconds(10)); });
  absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(table.ready(second, at::zeros({600}, at::kByte)));
  push.join();
  ASSERT_TRUE(begun.ok()) << begun;
  EXPECT_EQ(r.length, 600u);
  std::memset(r.dst, 5, r.length);
  table.end_range(r.claim, true);
  EXPECT_TRUE(table.await(second, absl::Seconds(1), absl::Now() + absl::Seconds(5)));
  EXPECT_EQ(second->tensor[599].item<uint8_t>(), 5);
}

TEST(BulkClaimsTest, ClosingFailsARangeWaitingForItsClaimAtOnce) {
  ClaimTable table;
  absl::Status waited;
  const absl::Time start = absl::Now();
  std::thread push([&] {
    Range r;
    waited = begin(&table, 1, 7, 100, 1, 0, &r, absl::Seconds(30));
  });
  absl::SleepFor(absl::Milliseconds(100));
  table.close();
  push.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kCancelled);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace ddprpc::rpc::transport::bulk
