// The bulk path's receive cache: tensors it hands out, buffers coming back
// and going back to the kernel, its bounds, and tensors that outlive it.
#include "rpc/transport/internal/bulk_receive_cache.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "rpc/wire/codec.h"

namespace ddprpc::rpc::transport::bulk {
namespace {

constexpr int64_t kMiB = 1 << 20;

TEST(ReceiveCacheTest, HandsOutTensorsOfTheShapeAskedAndTakesTheirBuffersBack) {
  auto cache = ReceiveCache::create({64 * kMiB, absl::Seconds(60)});
  void* first = nullptr;
  {
    at::Tensor t = cache->allocate(at::kFloat, {1024, 1024});
    EXPECT_EQ(t.scalar_type(), at::kFloat);
    EXPECT_EQ(t.sizes(), (std::vector<int64_t>{1024, 1024}));
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_TRUE(t.device().is_cpu());
    first = t.data_ptr();
    t.copy_(at::arange(1 << 20, at::kFloat).view({1024, 1024}));
    EXPECT_TRUE(at::equal(t.view({-1}), at::arange(1 << 20, at::kFloat)));
    EXPECT_EQ(cache->idle_buffers(), 0);
  }
  EXPECT_EQ(cache->idle_buffers(), 1);
  EXPECT_EQ(cache->idle_bytes(), 4 * kMiB);
  // The same size again: the same buffer, no new mapping.
  at::Tensor again = cache->allocate(at::kInt, {kMiB});
  EXPECT_EQ(again.data_ptr(), first);
  EXPECT_EQ(cache->reused(), 1);
  EXPECT_EQ(cache->idle_buffers(), 0);
}

TEST(ReceiveCacheTest, ABufferMuchLargerThanAskedIsNotTaken) {
  auto cache = ReceiveCache::create({64 * kMiB, absl::Seconds(60)});
  cache->allocate(at::kByte, {8 * kMiB});  // dropped at once: idle
  ASSERT_EQ(cache->idle_buffers(), 1);
  at::Tensor small = cache->allocate(at::kByte, {1 * kMiB});
  EXPECT_EQ(cache->reused(), 0);
  EXPECT_EQ(cache->idle_buffers(), 1);
  at::Tensor close_enough = cache->allocate(at::kByte, {7 * kMiB});
  EXPECT_EQ(cache->reused(), 1);
}

TEST(ReceiveCacheTest, KeepsNoMoreIdleBytesThanItsBound) {
  auto cache = ReceiveCache::create({6 * kMiB, absl::Seconds(60)});
  {
    std::vector<at::Tensor> held;
    for (int i = 0; i < 4; ++i) held.push_back(cache->allocate(at::kByte, {2 * kMiB}));
  }
  EXPECT_EQ(cache->idle_buffers(), 3);
  EXPECT_EQ(cache->idle_bytes(), 6 * kMiB);
}

TEST(ReceiveCacheTest, IdleBuffersExpire) {
  auto cache = ReceiveCache::create({64 * kMiB, absl::Milliseconds(1)});
  cache->allocate(at::kByte, {kMiB});
  ASSERT_EQ(cache->idle_buffers(), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  // The next allocation drops the expired buffer and maps a new one.
  at::Tensor t = cache->allocate(at::kByte, {kMiB});
  EXPECT_EQ(cache->reused(), 0);
  EXPECT_EQ(cache->idle_buffers(), 0);
}

TEST(ReceiveCacheTest, TensorsOutliveTheCacheAndItsClose) {
  at::Tensor kept;
  {
    auto cache = ReceiveCache::create({64 * kMiB, absl::Seconds(60)});
    cache->allocate(at::kByte, {kMiB});
    kept = cache->allocate(at::kLong, {1000});
    kept.copy_(at::arange(1000, at::kLong));
    cache->close();
    EXPECT_EQ(cache->idle_buffers(), 0);
  }
  // The cache object lives on in the tensor; its buffer is freed with it.
  EXPECT_TRUE(at::equal(kept, at::arange(1000, at::kLong)));
  kept = at::Tensor();
}

TEST(ReceiveCacheTest, ABufferGivenBackAfterCloseIsFreed) {
  auto cache = ReceiveCache::create({64 * kMiB, absl::Seconds(60)});
  at::Tensor t = cache->allocate(at::kByte, {kMiB});
  cache->close();
  t = at::Tensor();
  EXPECT_EQ(cache->idle_buffers(), 0);
}

TEST(ReceiveCacheTest, ItsTensorsResizeLikeAnyOther) {
  auto cache = ReceiveCache::create({64 * kMiB, absl::Seconds(60)});
  at::Tensor t = cache->allocate(at::kInt, {256 * 1024});
  t.copy_(at::arange(256 * 1024, at::kInt));
  t.resize_({4 * 256 * 1024});  // beyond its buffer: moved to the CPU allocator
  EXPECT_TRUE(at::equal(t.slice(0, 0, 256 * 1024), at::arange(256 * 1024, at::kInt)));
  EXPECT_EQ(cache->idle_buffers(), 1);  // the old buffer came back
}

TEST(ReceiveCacheTest, ManyThreadsTakeAndGiveBack) {
  auto cache = ReceiveCache::create({16 * kMiB, absl::Seconds(60)});
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&cache, i] {
      for (int r = 0; r < 200; ++r) {
        at::Tensor t = cache->allocate(at::kByte, {(1 + (r + i) % 3) * kMiB});
        t.fill_(static_cast<uint8_t>(r));
        ASSERT_EQ(t[t.numel() - 1].item<uint8_t>(), static_cast<uint8_t>(r));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_GT(cache->reused(), 0);
  EXPECT_LE(cache->idle_bytes(), 16 * kMiB);
}

TEST(ReceiveCacheTest, TheCodecMakesItsTensorsThroughIt) {
  auto cache = ReceiveCache::create({64 * kMiB, absl::Seconds(60)});
  wire::TensorMeta meta;
  meta.set_dtype(static_cast<int>(at::kFloat));
  meta.add_sizes(3);
  meta.add_sizes(kMiB / 4);
  meta.set_requires_grad(true);
  int made = 0;
  at::Tensor t = rpc::internal::allocate_tensor(meta, [&](c10::ScalarType dtype, c10::IntArrayRef sizes) {
    ++made;
    return cache->allocate(dtype, sizes);
  });
  EXPECT_EQ(made, 1);
  EXPECT_TRUE(t.requires_grad());
  EXPECT_EQ(t.sizes(), (std::vector<int64_t>{3, kMiB / 4}));
}

}  // namespace
}  // namespace ddprpc::rpc::transport::bulk
