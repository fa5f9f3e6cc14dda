// ProcessGroupGloo and DistributedDataParallel across real processes.
#include "ddp/distributed_data_parallel.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/Context.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include <ATen/ops/arange.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>
#include <ATen/ops/remainder.h>
#include <ATen/ops/sin.h>

#include "ddp/internal/op_queue.h"
#include "ddp/internal/same_host_allreduce.h"
#include "ddp/internal/shm_allreduce.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "rpc/rendezvous/launch.h"
#include "rpc/rendezvous/store.h"
#include "tests/multiprocess.h"

namespace ddp = ddprpc::ddp;
namespace mp = ddprpc::testing;

namespace {

// The tests' groups: the same-host allreduce off when the tests run the
// paths of ranks on separate hosts (mp::network_paths_only()).
ddp::ProcessGroupOptions group_options() {
  ddp::ProcessGroupOptions o;
  o.same_host_allreduce = !mp::network_paths_only();
  return o;
}

std::shared_ptr<ddp::ProcessGroup> group() {
  return ddp::init_process_group("gloo", "env://", -1, -1, group_options());
}

// The store at MASTER_ADDR:MASTER_PORT, served by rank 0 (as an RPC agent
// would host it), and this rank's client of it.
struct RankStore {
  std::unique_ptr<ddprpc::rpc::StoreServer> server;  // rank 0 only
  std::shared_ptr<ddprpc::rpc::Store> store;
};
RankStore rank_store_at_master(absl::Duration timeout) {
  const std::string host = std::getenv("MASTER_ADDR");
  const int port = std::atoi(std::getenv("MASTER_PORT"));
  RankStore out;
  if (mp::rank() == 0) out.server = ddprpc::rpc::StoreServer::start(host, port);
  out.store = std::make_shared<ddprpc::rpc::Store>(host, port, timeout);
  return out;
}

MULTIPROCESS_TEST(ProcessGroupTest, CollectivesGiveTheExpectedValues, 3) {
  auto pg = group();
  const double r = mp::rank();
  at::Tensor a = at::full({4}, r + 1), b = at::full({2, 2}, r * 10);
  pg->allreduce({a, b}, ddp::ReduceOp::kSum)->wait();
  EXPECT_TRUE(at::allclose(a, at::full({4}, 6.0)));
  EXPECT_TRUE(at::allclose(b, at::full({2, 2}, 30.0)));
  at::Tensor m = at::full({3}, r);
  pg->allreduce({m}, ddp::ReduceOp::kMax)->wait();
  EXPECT_TRUE(at::allclose(m, at::full({3}, 2.0)));
  at::Tensor avg = at::full({3}, r);
  pg->allreduce({avg}, ddp::ReduceOp::kAvg)->wait();
  EXPECT_TRUE(at::allclose(avg, at::full({3}, 1.0)));
  at::Tensor x = at::full({2}, r + 5);
  pg->broadcast({x}, 1)->wait();
  EXPECT_TRUE(at::allclose(x, at::full({2}, 6.0)));
  std::vector<at::Tensor> outs = {at::empty({2}), at::empty({2}), at::empty({2})};
  pg->allgather(outs, at::full({2}, r))->wait();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(at::allclose(outs[i], at::full({2}, double(i))));
  pg->barrier()->wait();
}

// Small allreduces run on cached per-shape algorithms (synchronous mesh),
// large ones and those past the cache's size on Gloo's collective API: both
// must give exact sums, however often a shape repeats and in any mix.
// allreduce_and_wait runs after what the group has queued (here a
// broadcast nobody waited for), and gives what allreduce gives.
MULTIPROCESS_TEST(ProcessGroupTest, AllreduceAndWaitRunsAfterWhatIsQueued, 2) {
  auto pg = group();
  const double r = mp::rank();
  at::Tensor x = at::full({3}, r == 0 ? 1.0 : 5.0);
  std::shared_ptr<ddp::Work> broadcast = pg->broadcast({x}, 0);
  pg->allreduce_and_wait({x}, ddp::ReduceOp::kSum, absl::Seconds(60));
  EXPECT_TRUE(broadcast->completed());
  EXPECT_TRUE(at::allclose(x, at::full({3}, 2.0))) << x;  // 1 + 1: the broadcast came first
  at::Tensor y = at::full({2}, r + 1);
  pg->allreduce_and_wait({y}, ddp::ReduceOp::kAvg, absl::Seconds(60));
  EXPECT_TRUE(at::allclose(y, at::full({2}, 1.5))) << y;
}

// An idle queue runs run_now's operation on the calling thread; a busy one
// runs it on its own thread after what it holds, in order; errors name the
// operation either way.
TEST(OpQueueTest, RunNowRunsHereWhenIdleAndInOrderOtherwise) {
  ddp::internal::OpQueue queue;
  std::thread::id ran_on;
  queue.run_now("op", [&] { ran_on = std::this_thread::get_id(); }, absl::Seconds(10));
  EXPECT_EQ(ran_on, std::this_thread::get_id());

  absl::Notification release;
  std::vector<int> order;
  std::shared_ptr<ddp::Work> first = queue.enqueue("first", [&] {
    release.WaitForNotification();
    order.push_back(1);
  });
  std::thread releaser([&] {
    absl::SleepFor(absl::Milliseconds(50));
    release.Notify();
  });
  queue.run_now("second", [&] {
    order.push_back(2);
    ran_on = std::this_thread::get_id();
  }, absl::Seconds(10));
  releaser.join();
  EXPECT_TRUE(first->completed());
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_NE(ran_on, std::this_thread::get_id());

  try {
    queue.run_now("third", [] { throw std::runtime_error("broken"); }, absl::Seconds(10));
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "third failed: broken");
  }
  // Whatever is thrown, and with an empty message, fails the operation and
  // leaves the queue usable.
  EXPECT_THROW(queue.run_now("fourth", [] { throw 7; }, absl::Seconds(10)), std::runtime_error);
  EXPECT_THROW(queue.run_now("fifth", [] { throw std::runtime_error(""); }, absl::Seconds(10)),
               std::runtime_error);
  EXPECT_THROW(queue.enqueue("sixth", [] { throw 7; })->wait(absl::Seconds(10)),
               std::runtime_error);
  bool ran = false;
  queue.enqueue("seventh", [&] { ran = true; })->wait(absl::Seconds(10));
  EXPECT_TRUE(ran);
}

MULTIPROCESS_TEST(ProcessGroupTest, RepeatedAndManyShapesGiveExactSums, 3) {
  auto pg = group();
  const double r = mp::rank();
  for (int round = 0; round < 3; ++round) {
    for (int64_t n : {1, 7, 1000, 40, 3, 2 << 20, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18}) {
      at::Tensor t = at::full({n}, r + round + 1, at::kDouble);
      pg->allreduce({t}, ddp::ReduceOp::kSum)->wait(absl::Seconds(60));
      ASSERT_TRUE(at::equal(t, at::full({n}, 3.0 * (round + 2), at::kDouble)))
          << "round " << round << ", " << n << " elements";
    }
    at::Tensor lo = at::full({64}, r), hi = at::full({64}, r);
    pg->allreduce({lo}, ddp::ReduceOp::kMin)->wait(absl::Seconds(60));
    pg->allreduce({hi}, ddp::ReduceOp::kMax)->wait(absl::Seconds(60));
    EXPECT_TRUE(at::equal(lo, at::zeros({64})));
    EXPECT_TRUE(at::equal(hi, at::full({64}, 2.0)));
  }
}

MULTIPROCESS_TEST(ProcessGroupTest, DeadRankFailsTheOthersWithinTheTimeout, 3) {
  ddp::ProcessGroupOptions options = group_options();
  options.timeout = absl::Seconds(5);
  auto pg = ddp::init_process_group("gloo", "env://", -1, -1, options);
  pg->barrier()->wait();
  if (mp::rank() == 2) mp::die_abruptly();
  absl::Time start = absl::Now();
  at::Tensor t = at::ones({1000});
  try {
    pg->allreduce({t})->wait(absl::Seconds(30));
    ADD_FAILURE() << "allreduce with a dead rank succeeded";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("allreduce"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("of 3"), std::string::npos) << e.what();
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

// Between hosts (the same-host allreduce off), allreduces from 256 KiB run
// the group's TCP ring; a group one of whose ranks turns it off runs Gloo's
// ring on every rank. Striped over three rings (one rank asking for four:
// the fewest wins), or over two, each part on its own ring at once. All give
// the exact results, for each op and dtype.
MULTIPROCESS_TEST(ProcessGroupTest, LargeAllreducesBetweenHostsWithAndWithoutTheTcpRing, 3) {
  const int r = mp::rank();
  ddp::ProcessGroupOptions with_ring;
  with_ring.same_host_allreduce = false;
  with_ring.tcp_ring_streams = 1;
  ddp::ProcessGroupOptions mixed = with_ring;
  mixed.tcp_ring = r != 1;
  ddp::ProcessGroupOptions striped = with_ring;
  striped.tcp_ring_streams = r == 2 ? 4 : 3;
  ddp::ProcessGroupOptions two = with_ring;
  two.tcp_ring_streams = r == 0 ? 2 : 5;
  const RankStore rank_store = rank_store_at_master(absl::Seconds(60));
  for (const auto& [prefix, options] :
       {std::pair{"ring/", with_ring}, std::pair{"mixed/", mixed},
        std::pair{"striped/", striped}, std::pair{"two/", two}}) {
    SCOPED_TRACE(prefix);
    auto pg = ddp::make_gloo_group(rank_store.store, prefix, r, 3, options);
    constexpr int64_t kNumel = (3 << 20) / 4 + 5;  // 3 MiB of floats, not a multiple of 3
    at::Tensor index = at::arange(kNumel, at::kFloat);
    at::Tensor sum = at::remainder(index, 13) + r;
    pg->allreduce({sum}, ddp::ReduceOp::kSum)->wait(absl::Seconds(60));
    ASSERT_TRUE(at::equal(sum, at::remainder(index, 13) * 3 + 3));
    at::Tensor avg = at::remainder(index, 13) + r;
    pg->allreduce({avg}, ddp::ReduceOp::kAvg)->wait(absl::Seconds(60));
    ASSERT_TRUE(at::equal(avg, at::remainder(index, 13) + 1));
    at::Tensor max = at::remainder(index + r, 3).to(at::kHalf);
    pg->allreduce({max}, ddp::ReduceOp::kMax)->wait(absl::Seconds(60));
    ASSERT_TRUE(at::equal(max, at::full({kNumel}, 2.0, at::kHalf)));
    at::Tensor any = at::remainder(index + r, 3).eq(0);  // bool: a sum is a logical or
    pg->allreduce({any}, ddp::ReduceOp::kSum)->wait(absl::Seconds(60));
    ASSERT_TRUE(any.all().item<bool>());
    // Two tensors of different shapes, packed.
    at::Tensor a = at::full({700, 1000}, r + 1.0), b = at::full({300001}, 2.0 * r);
    pg->allreduce({a, b}, ddp::ReduceOp::kSum)->wait(absl::Seconds(60));
    ASSERT_TRUE(at::equal(a, at::full({700, 1000}, 6.0)));
    ASSERT_TRUE(at::equal(b, at::full({300001}, 6.0)));
  }
}

// A rank that dies in a large allreduce between hosts fails the others at
// once, not at the group's timeout: rank 2 dies while large allreduces run
// on `rings` TCP rings, and the other ranks fail within 20 s, each naming
// its ring.
void dead_rank_fails_large_allreduces(int rings) {
  ddp::ProcessGroupOptions options;
  options.same_host_allreduce = false;
  options.timeout = absl::Seconds(60);
  options.tcp_ring_streams = rings;
  auto pg = ddp::init_process_group("gloo", "env://", -1, -1, options);
  at::Tensor t = at::ones({16 << 20});  // 64 MiB
  pg->allreduce({t})->wait(absl::Seconds(60));
  pg->barrier()->wait();
  if (mp::rank() == 2) {
    std::thread([] {
      absl::SleepFor(absl::Milliseconds(50));
      mp::die_abruptly();
    }).detach();
  }
  const absl::Time start = absl::Now();
  try {
    for (int i = 0; i < 100; ++i) pg->allreduce({t})->wait(absl::Seconds(60));
    ADD_FAILURE() << "allreduces with a dead rank succeeded";
  } catch (const std::exception& e) {
    // Both neighbours of rank 2 fail, and each shuts its connections, so a
    // rank may see its other neighbour's shutdown before rank 2's end:
    // rank 0 reads from rank 2 and writes to rank 1, rank 1 writes to rank
    // 2 and reads from rank 0.
    const std::string what = e.what();
    EXPECT_NE(what.find("TcpRing (rank " + std::to_string(mp::rank()) + " of 3)"),
              std::string::npos)
        << what;
    if (mp::rank() == 0) {
      EXPECT_TRUE(what.find("rank 2 closed its connection") != std::string::npos ||
                  what.find("the connection with rank 1") != std::string::npos)
          << what;
    }
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

MULTIPROCESS_TEST(ProcessGroupTest, DeadRankFailsALargeAllreduceBetweenHosts, 3) {
  dead_rank_fails_large_allreduces(1);
}

// The same with the allreduce striped over three rings at once.
MULTIPROCESS_TEST(ProcessGroupTest, DeadRankFailsAStripedAllreduceBetweenHosts, 3) {
  dead_rank_fails_large_allreduces(3);
}

// After one ring of a striped group fails, every later allreduce on the
// rings fails at once, whichever rings it would use: rank 2 stops taking
// part; a small allreduce (one ring) fails at the timeout, and the large
// one after it (both rings) fails without waiting on the ring that has not
// failed yet.
MULTIPROCESS_TEST(ProcessGroupTest, ARingThatFailedFailsLaterStripedAllreducesAtOnce, 3) {
  ddp::ProcessGroupOptions options;
  options.same_host_allreduce = false;
  options.tcp_ring_streams = 2;
  options.timeout = absl::Seconds(2);
  const RankStore rank_store = rank_store_at_master(absl::Seconds(60));
  auto& store = *rank_store.store;
  // The group forms within the 2 s timeout however far apart the processes
  // started.
  store.set(absl::StrCat("striped_ready/", mp::rank()), "1");
  for (int r = 0; r < 3; ++r) store.get(absl::StrCat("striped_ready/", r));
  auto pg = ddp::make_gloo_group(rank_store.store, "striped/", mp::rank(), 3, options);
  if (mp::rank() == 2) {
    // Alive, and calling nothing, until the others have checked; then the
    // store (rank 0's) may go.
    for (int r = 0; r < 2; ++r) store.get(absl::StrCat("striped_checked/", r));
    store.set("striped_left/2", "1");
    return;
  }
  at::Tensor small = at::ones({(300 << 10) / 4});
  EXPECT_THROW(pg->allreduce({small})->wait(absl::Seconds(30)), std::exception);
  at::Tensor large = at::ones({(1 << 20) / 4});
  const absl::Time start = absl::Now();
  try {
    pg->allreduce({large})->wait(absl::Seconds(30));
    ADD_FAILURE() << "an allreduce on a failed ring succeeded";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("failed in an earlier allreduce"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  store.set(absl::StrCat("striped_checked/", mp::rank()), "1");
  if (mp::rank() == 0) store.get("striped_left/2");  // after rank 1's last call too
}

// A group built on an existing store (as when RPC already hosts one): two
// groups under different prefixes share it without mixing their keys.
MULTIPROCESS_TEST(ProcessGroupTest, GroupsShareOneStoreUnderPrefixes, 2) {
  const RankStore rank_store = rank_store_at_master(absl::Seconds(30));
  const auto& store = rank_store.store;
  auto a = ddp::make_gloo_group(store, "a/", mp::rank(), 2, group_options());
  auto b = ddp::make_gloo_group(store, "b/", mp::rank(), 2, group_options());
  EXPECT_EQ(a->rank(), mp::rank());
  EXPECT_EQ(b->size(), 2);
  EXPECT_EQ(a->backend(), "gloo");
  const double r = mp::rank();
  at::Tensor x = at::full({3}, r + 1), y = at::full({3}, 10 * (r + 1));
  auto wa = a->allreduce({x}), wb = b->allreduce({y});
  wa->wait(absl::Seconds(30));
  wb->wait(absl::Seconds(30));
  EXPECT_TRUE(wa->completed());
  EXPECT_TRUE(at::allclose(x, at::full({3}, 3.0)));
  EXPECT_TRUE(at::allclose(y, at::full({3}, 30.0)));
  // Nobody uses the store once both groups are past this point.
  a->barrier()->wait(absl::Seconds(30));
  b->barrier()->wait(absl::Seconds(30));
}

// Large allreduces among processes of one host read the peers' buffers
// (internal/same_host_allreduce.h): exact sums, max, min and averages for
// sizes that do not split evenly, several dtypes and a bucket of several
// tensors; with one rank unwilling every rank keeps Gloo's path, same
// results.
MULTIPROCESS_TEST(ProcessGroupTest, LargeAllreducesOnOneHostMatchGloo, 3) {
  using ddprpc::ddp::internal::SameHostAllreduce;
  const RankStore rank_store = rank_store_at_master(absl::Seconds(60));
  const auto& store = rank_store.store;
  const int64_t r = mp::rank();
  const int64_t n = 300001;  // 1.2 MB of floats, not a multiple of 3
  auto check = [&](ddp::ProcessGroup& pg) {
    // rank r holds (i * (r + 1)) % 1000 at index i.
    auto values = [&](at::ScalarType type, int64_t rank) {
      return at::remainder(at::arange(n, at::kLong) * (rank + 1), 1000).to(type);
    };
    at::Tensor expect_sum = values(at::kLong, 0) + values(at::kLong, 1) + values(at::kLong, 2);
    at::Tensor expect_max = at::maximum(at::maximum(values(at::kLong, 0), values(at::kLong, 1)),
                                        values(at::kLong, 2));
    at::Tensor expect_min = at::minimum(at::minimum(values(at::kLong, 0), values(at::kLong, 1)),
                                        values(at::kLong, 2));
    at::Tensor sum = values(at::kLong, r), mx = values(at::kFloat, r), mn = values(at::kDouble, r);
    at::Tensor avg = values(at::kDouble, r);
    pg.allreduce({sum}, ddp::ReduceOp::kSum)->wait(absl::Seconds(60));
    pg.allreduce({mx}, ddp::ReduceOp::kMax)->wait(absl::Seconds(60));
    pg.allreduce({mn}, ddp::ReduceOp::kMin)->wait(absl::Seconds(60));
    pg.allreduce({avg}, ddp::ReduceOp::kAvg)->wait(absl::Seconds(60));
    EXPECT_TRUE(at::equal(sum, expect_sum));
    EXPECT_TRUE(at::equal(mx, expect_max.to(at::kFloat)));
    EXPECT_TRUE(at::equal(mn, expect_min.to(at::kDouble)));
    EXPECT_TRUE(at::allclose(avg, expect_sum.to(at::kDouble) / 3));
    // A bucket of tensors of several shapes, flattened together.
    at::Tensor a = values(at::kFloat, r).narrow(0, 0, 200000).reshape({400, 500}).clone();
    at::Tensor b = values(at::kFloat, r).narrow(0, 200000, 100001).clone();
    pg.allreduce({a, b}, ddp::ReduceOp::kSum)->wait(absl::Seconds(60));
    EXPECT_TRUE(at::equal(a.reshape(-1), expect_sum.narrow(0, 0, 200000).to(at::kFloat)));
    EXPECT_TRUE(at::equal(b, expect_sum.narrow(0, 200000, 100001).to(at::kFloat)));
  };
  // With the network paths only (CI's second pass), every rank keeps Gloo's.
  const bool fast = !mp::network_paths_only();
  const int64_t before = SameHostAllreduce::runs();
  {
    auto pg = ddp::make_gloo_group(store, "fast/", mp::rank(), 3, group_options());
    check(*pg);
    EXPECT_EQ(SameHostAllreduce::runs() - before, fast ? 5 : 0)
        << "large allreduces took the wrong path";
    pg->barrier()->wait(absl::Seconds(60));
  }
  ddp::ProcessGroupOptions one_out = group_options();
  if (r == 1) one_out.same_host_allreduce = false;
  {
    auto pg = ddp::make_gloo_group(store, "slow/", mp::rank(), 3, one_out);
    check(*pg);
    EXPECT_EQ(SameHostAllreduce::runs() - before, fast ? 5 : 0)
        << "one rank opted out, yet peers were read";
    pg->barrier()->wait(absl::Seconds(60));
  }
}

// Gloo's half loops (built without AVX) skip a store when the new bits
// equal the half encoding of the old bits read as an integer: 2 + 3 into a
// destination holding the bits 0x0005 leaves them there, since 5.0 is
// 0x4500 = half(5). The group's reductions store every result.
TEST(ReductionTest, HalfResultsAreAlwaysStored) {
  using namespace ddprpc::ddp::internal;
  const c10::Half two(2.0f), three(3.0f);
  for (Reduction op : {Reduction::kSum, Reduction::kMax, Reduction::kMin}) {
    const float want = op == Reduction::kSum ? 5.0f : op == Reduction::kMax ? 3.0f : 2.0f;
    c10::Half out;
    // The trap: old bits whose integer value encodes to the result.
    out.x = static_cast<uint16_t>(static_cast<int>(want));
    reduce_fn(at::kHalf, op)(&out, &two, &three, 1);
    EXPECT_EQ(static_cast<float>(out), want) << "op " << static_cast<int>(op);
    c10::Half x = two;
    reduction_function<gloo::float16>(op)->call(reinterpret_cast<gloo::float16*>(&x),
                                                reinterpret_cast<const gloo::float16*>(&three), 1);
    EXPECT_EQ(static_cast<float>(x), want) << "op " << static_cast<int>(op);
  }
}

// The vector sums give the scalar loop's bits at every length (whole
// vectors and a tail), with the output apart from or equal to an input.
TEST(ReductionTest, VectorSumsMatchTheScalarLoopBitForBit) {
  using namespace ddprpc::ddp::internal;
  for (int64_t n : {0, 1, 7, 8, 9, 31, 1000, 4099}) {
    for (at::ScalarType type : {at::kFloat, at::kDouble}) {
      SCOPED_TRACE(testing::Message() << n << " of " << c10::toString(type));
      // Magnitudes from 1e-3 to 1e3, so that sums round.
      const at::Tensor a = at::randn({n}, type) * at::exp(at::randn({n}, type) * 3);
      const at::Tensor b = at::randn({n}, type) * at::exp(at::randn({n}, type) * 3);
      at::Tensor want = at::empty_like(a);
      const ReduceFn scalar = type == at::kFloat ? static_cast<ReduceFn>(&gloo::sum<float>)
                                                 : static_cast<ReduceFn>(&gloo::sum<double>);
      scalar(want.data_ptr(), a.data_ptr(), b.data_ptr(), n);
      at::Tensor out = at::empty_like(a);
      reduce_fn(type, Reduction::kSum)(out.data_ptr(), a.data_ptr(), b.data_ptr(), n);
      EXPECT_TRUE(at::equal(out, want));
      at::Tensor in_place = a.clone();
      reduce_fn(type, Reduction::kSum)(in_place.data_ptr(), in_place.data_ptr(), b.data_ptr(), n);
      EXPECT_TRUE(at::equal(in_place, want));
    }
  }
}

// Allreduces of at most 1 MiB among processes of one host go through a
// shared-memory segment (internal/shm_allreduce.h): exact sums, max, min
// and averages for several dtypes and sizes (one element, sizes that do
// not split evenly, exactly 1 MiB), a bucket mixing a non-contiguous
// tensor, the same bits on every rank, and Gloo's path beyond 1 MiB or
// when one rank opts out (where lists are no longer reduced in place).
MULTIPROCESS_TEST(ProcessGroupTest, SmallAllreducesOnOneHostGoThroughSharedMemory, 3) {
  using ddprpc::ddp::internal::ShmAllreduce;
  const RankStore rank_store = rank_store_at_master(absl::Seconds(60));
  const auto& store = rank_store.store;
  const int64_t r = mp::rank();
  auto values = [](int64_t n, at::ScalarType type, int64_t rank) {
    return at::remainder(at::arange(n, at::kLong) * (rank + 1) + rank, 97).to(type);
  };
  // Returns {allreduces that went through shared memory, those of at most
  // 1 MiB}.
  auto check = [&](ddp::ProcessGroup& pg) -> std::pair<int64_t, int64_t> {
    const int64_t before = ShmAllreduce::runs();
    int64_t small = 4;  // the last four below
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, ShmAllreduce::kMaxBytes / 4,
                      ShmAllreduce::kMaxBytes / 4 + 1, int64_t{5}}) {
      for (at::ScalarType type : {at::kFloat, at::kDouble, at::kLong, at::kInt, at::kHalf}) {
        const int64_t bytes = n * static_cast<int64_t>(c10::elementSize(type));
        small += bytes <= ShmAllreduce::kMaxBytes ? 3 : 0;
        at::Tensor sum = values(n, type, r), mx = values(n, type, r), mn = values(n, type, r),
                   avg = values(n, at::kDouble, r);
        small += n * 8 <= ShmAllreduce::kMaxBytes ? 1 : 0;  // avg is double
        pg.allreduce({sum}, ddp::ReduceOp::kSum)->wait(absl::Seconds(60));
        pg.allreduce({mx}, ddp::ReduceOp::kMax)->wait(absl::Seconds(60));
        pg.allreduce({mn}, ddp::ReduceOp::kMin)->wait(absl::Seconds(60));
        pg.allreduce({avg}, ddp::ReduceOp::kAvg)->wait(absl::Seconds(60));
        at::Tensor v0 = values(n, at::kLong, 0), v1 = values(n, at::kLong, 1),
                   v2 = values(n, at::kLong, 2);
        EXPECT_TRUE(at::equal(sum, (v0 + v1 + v2).to(type))) << n << " elements of " << type;
        EXPECT_TRUE(at::equal(mx, at::maximum(at::maximum(v0, v1), v2).to(type))) << n;
        EXPECT_TRUE(at::equal(mn, at::minimum(at::minimum(v0, v1), v2).to(type))) << n;
        EXPECT_TRUE(at::allclose(avg, (v0 + v1 + v2).to(at::kDouble) / 3)) << n;
      }
    }
    // bfloat16, bool, uint8 and int8 on values whose sums every one of them
    // holds exactly (bool: a sum and a max are an or, a min an and).
    for (int64_t n : {int64_t{1}, int64_t{1000}, ShmAllreduce::kMaxBytes / 2,
                      ShmAllreduce::kMaxBytes + 1}) {
      for (at::ScalarType type : {at::kBFloat16, at::kBool, at::kByte, at::kChar}) {
        auto small_values = [&](int64_t rank) { return at::remainder(values(n, at::kLong, rank), 5); };
        const int64_t bytes = n * static_cast<int64_t>(c10::elementSize(type));
        small += bytes <= ShmAllreduce::kMaxBytes ? 3 : 0;
        at::Tensor sum = small_values(r).to(type), mx = sum.clone(), mn = sum.clone();
        pg.allreduce({sum}, ddp::ReduceOp::kSum)->wait(absl::Seconds(60));
        pg.allreduce({mx}, ddp::ReduceOp::kMax)->wait(absl::Seconds(60));
        pg.allreduce({mn}, ddp::ReduceOp::kMin)->wait(absl::Seconds(60));
        at::Tensor v0 = small_values(0), v1 = small_values(1), v2 = small_values(2);
        EXPECT_TRUE(at::equal(sum, (v0 + v1 + v2).to(type))) << n << " elements of " << type;
        EXPECT_TRUE(at::equal(mx, at::maximum(at::maximum(v0, v1), v2).to(type))) << n << type;
        EXPECT_TRUE(at::equal(mn, at::minimum(at::minimum(v0, v1), v2).to(type))) << n << type;
      }
    }
    at::Tensor bavg = at::remainder(values(1000, at::kLong, r), 5).to(at::kBFloat16);
    pg.allreduce({bavg}, ddp::ReduceOp::kAvg)->wait(absl::Seconds(60));
    small += 1;
    EXPECT_TRUE(at::allclose(bavg.to(at::kFloat),
                             (at::remainder(values(1000, at::kLong, 0), 5) +
                              at::remainder(values(1000, at::kLong, 1), 5) +
                              at::remainder(values(1000, at::kLong, 2), 5)).to(at::kFloat) / 3,
                             1e-2, 1e-2));
    // Fractions: every rank ends with the same bits.
    auto fractions = [](int64_t rank) {
      return at::sin(at::arange(4099, at::kFloat) * (rank + 1)) * 1e3 + 1.0 / (rank + 3);
    };
    at::Tensor f = fractions(r);
    pg.allreduce({f}, ddp::ReduceOp::kSum)->wait(absl::Seconds(60));
    at::Tensor hi = f.clone(), lo = f.clone();
    pg.allreduce({hi}, ddp::ReduceOp::kMax)->wait(absl::Seconds(60));
    pg.allreduce({lo}, ddp::ReduceOp::kMin)->wait(absl::Seconds(60));
    EXPECT_TRUE(at::equal(hi, f) && at::equal(lo, f)) << "ranks hold different sums";
    EXPECT_TRUE(at::allclose(f, fractions(0) + fractions(1) + fractions(2), 1e-6, 1e-3));
    // Averages: a float one is divided inside the reduction, yet holds the
    // bits of the sum divided afterwards; a half one is divided after it.
    at::Tensor favg = fractions(r);
    pg.allreduce({favg}, ddp::ReduceOp::kAvg)->wait(absl::Seconds(60));
    EXPECT_TRUE(at::equal(favg, f / 3)) << "the average is not the sum divided by the size";
    at::Tensor havg = values(1000, at::kHalf, r);
    pg.allreduce({havg}, ddp::ReduceOp::kAvg)->wait(absl::Seconds(60));
    EXPECT_TRUE(at::allclose(havg.to(at::kFloat),
                             (values(1000, at::kLong, 0) + values(1000, at::kLong, 1) +
                              values(1000, at::kLong, 2)).to(at::kFloat) / 3,
                             1e-3, 0.1));
    small += 2;
    // A bucket of several tensors, one of them a transposed view.
    at::Tensor a = values(600, at::kFloat, r).reshape({20, 30}).t();
    at::Tensor b = values(11, at::kFloat, r);
    pg.allreduce({a, b}, ddp::ReduceOp::kSum)->wait(absl::Seconds(60));
    at::Tensor expect = values(611, at::kLong, 0) + values(611, at::kLong, 1) + values(611, at::kLong, 2);
    EXPECT_TRUE(at::equal(a, expect.narrow(0, 0, 600).to(at::kFloat).reshape({20, 30}).t()));
    EXPECT_TRUE(at::equal(b, (values(11, at::kLong, 0) + values(11, at::kLong, 1) +
                              values(11, at::kLong, 2)).to(at::kFloat)));
    return {ShmAllreduce::runs() - before, small};
  };
  const bool fast = !mp::network_paths_only();
  {
    auto pg = ddp::make_gloo_group(store, "shm/", mp::rank(), 3, group_options());
    const auto [runs, small] = check(*pg);
    // 1 MiB fits, 1 MiB + 2 bytes does not: 98 of float, double, long, int
    // and half, 37 of bfloat16, bool, uint8 and int8.
    EXPECT_EQ(small, 135);
    EXPECT_EQ(runs, fast ? small : 0);
    // What it tells a caller with separate tensors (DDP's buckets).
    EXPECT_EQ(pg->reduces_lists_in_place(ShmAllreduce::kMaxBytes), fast);
    EXPECT_FALSE(pg->reduces_lists_in_place(ShmAllreduce::kMaxBytes + 1));
    pg->barrier()->wait(absl::Seconds(60));
  }
  ddp::ProcessGroupOptions one_out = group_options();
  if (r == 1) one_out.same_host_allreduce = false;
  {
    auto pg = ddp::make_gloo_group(store, "gloo/", mp::rank(), 3, one_out);
    EXPECT_EQ(check(*pg).first, 0) << "one rank opted out, yet the others used shared memory";
    EXPECT_FALSE(pg->reduces_lists_in_place(1000));
    pg->barrier()->wait(absl::Seconds(60));
  }
}

// The message of an allreduce that must fail (a test failure if it does not).
std::string failed_allreduce(ddp::ProcessGroup& pg, at::Tensor& t) {
  try {
    pg.allreduce({t})->wait(absl::Seconds(30));
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "allreduce succeeded";
  return "";
}

// A group with `timeout` whose first allreduce (of `t`, 1000 ones) went
// through shared memory and summed.
std::shared_ptr<ddp::ProcessGroup> group_after_one_allreduce(absl::Duration timeout, at::Tensor& t) {
  ddp::ProcessGroupOptions options = group_options();
  options.timeout = timeout;
  auto pg = ddp::init_process_group("gloo", "env://", -1, -1, options);
  const int64_t before = ddprpc::ddp::internal::ShmAllreduce::runs();
  t = at::ones({1000});
  pg->allreduce({t})->wait(absl::Seconds(30));
  EXPECT_EQ(ddprpc::ddp::internal::ShmAllreduce::runs() - before, 1);
  EXPECT_TRUE(at::equal(t, at::full({1000}, 3.0)));
  return pg;
}

// Ranks whose same-host allreduces differ (here in size) fail together,
// naming the rank that differs, instead of returning a mix: through shared
// memory, and through cross-process reads (before any rank reads another's
// memory).
MULTIPROCESS_TEST(ProcessGroupTest, SameHostAllreducesThatDifferFailOnEveryRank, 3) {
  if (mp::network_paths_only()) GTEST_SKIP() << "same-host paths off";
  at::Tensor t;
  auto pg = group_after_one_allreduce(absl::Seconds(20), t);
  at::Tensor big = at::ones({(int64_t{8} << 20) / 4 + (mp::rank() == 1 ? 64 : 0)});
  std::string why = failed_allreduce(*pg, big);
  EXPECT_NE(why.find("every rank must make the same call"), std::string::npos) << why;
  EXPECT_NE(why.find(mp::rank() == 1 ? "rank 0 allreduces" : "rank 1 allreduces"),
            std::string::npos) << why;
  at::Tensor small = at::ones({mp::rank() == 2 ? 999 : 1000});
  why = failed_allreduce(*pg, small);
  EXPECT_NE(why.find("every rank must make the same call"), std::string::npos) << why;
  EXPECT_NE(why.find(mp::rank() == 2 ? "rank 0 makes call" : "rank 2 makes call"),
            std::string::npos) << why;
}

// A rank that stays alive but never comes fails the others' shared-memory
// allreduce when the group's timeout passes, naming it.
MULTIPROCESS_TEST(ProcessGroupTest, SharedMemoryAllreduceNamesTheRankItWaitsFor, 3) {
  if (mp::network_paths_only()) GTEST_SKIP() << "same-host paths off";
  at::Tensor t;
  auto pg = group_after_one_allreduce(absl::Seconds(3), t);
  if (mp::rank() == 2) {
    // Alive but absent for longer than the timeout, then gone.
    absl::SleepFor(absl::Seconds(6));
    mp::die_abruptly();
  }
  absl::Time start = absl::Now();
  const std::string why = failed_allreduce(*pg, t);
  EXPECT_NE(why.find("rank 2 (pid"), std::string::npos) << why;
  EXPECT_NE(why.find("did not arrive within 3s"), std::string::npos) << why;
  EXPECT_GE(absl::Now() - start, absl::Seconds(3));
  EXPECT_LT(absl::Now() - start, absl::Seconds(6));
  // The group is unusable now; it says so instead of waiting again.
  const std::string again = failed_allreduce(*pg, t);
  EXPECT_NE(again.find("unusable"), std::string::npos) << again;
}

// A rank that exits while the others wait fails theirs at once, naming it.
MULTIPROCESS_TEST(ProcessGroupTest, SharedMemoryAllreduceFailsAtOnceWhenARankExits, 3) {
  if (mp::network_paths_only()) GTEST_SKIP() << "same-host paths off";
  at::Tensor t;
  auto pg = group_after_one_allreduce(absl::Seconds(60), t);
  if (mp::rank() == 2) mp::die_abruptly();
  absl::Time start = absl::Now();
  const std::string why = failed_allreduce(*pg, t);
  EXPECT_NE(why.find("rank 2 (pid"), std::string::npos) << why;
  EXPECT_NE(why.find("exited"), std::string::npos) << why;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "waited for the timeout, not the exit";
}

// A rank whose group goes away (its training failed, say) while the
// others wait for it fails them at once, as a closed Gloo connection does.
MULTIPROCESS_TEST(ProcessGroupTest, SharedMemoryAllreduceFailsAtOnceWhenARankLeavesTheGroup, 3) {
  if (mp::network_paths_only()) GTEST_SKIP() << "same-host paths off";
  at::Tensor t;
  auto pg = group_after_one_allreduce(absl::Seconds(60), t);
  if (mp::rank() == 2) {
    pg.reset();
    absl::SleepFor(absl::Seconds(3));  // alive while the others notice
    return;
  }
  absl::Time start = absl::Now();
  const std::string why = failed_allreduce(*pg, t);
  EXPECT_NE(why.find("rank 2 (pid"), std::string::npos) << why;
  EXPECT_NE(why.find("left the group"), std::string::npos) << why;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "waited, though rank 2 had left";
}

torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
}

// The full batch every rank can build; rank r trains on rows [2r, 2r+2).
std::pair<at::Tensor, at::Tensor> full_batch(int step) {
  at::manual_seed(100 + step);
  return {at::randn({8, 6}), at::randn({8, 3})};
}

MULTIPROCESS_TEST(DdpTest, FourReplicasMatchSingleProcessTraining, 4) {
  auto pg = group();
  at::manual_seed(mp::rank());  // different init: DDP must broadcast rank 0's
  auto model = make_model();
  ddp::DistributedDataParallel ddp_model(model.ptr(), pg);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));

  at::manual_seed(0);
  auto reference = make_model();  // rank 0's initial parameters
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));

  for (int step = 0; step < 20; ++step) {
    auto [x, y] = full_batch(step);
    opt.zero_grad();
    const int r = mp::rank();
    at::mse_loss(model->forward(x.narrow(0, 2 * r, 2)), y.narrow(0, 2 * r, 2)).backward();
    opt.step();

    ref_opt.zero_grad();
    at::mse_loss(reference->forward(x), y).backward();
    ref_opt.step();

    // Identical on every rank after every step.
    for (const auto& p : model->parameters()) {
      at::Tensor lo = p.detach().clone(), hi = p.detach().clone();
      pg->allreduce({lo}, ddp::ReduceOp::kMin)->wait();
      pg->allreduce({hi}, ddp::ReduceOp::kMax)->wait();
      ASSERT_TRUE(at::equal(lo, hi)) << "replicas diverged at step " << step;
    }
  }
  auto params = model->parameters(), ref = reference->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::allclose(params[i], ref[i], 1e-5, 1e-5)) << "parameter " << i;
  }
}

// Between two layers: its backward throws while `armed` (a pass that fails
// after the last layer's gradients reached DDP, before the first's did).
bool g_throw_in_backward = false;
struct ThrowInBackward : public torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    if (g_throw_in_backward) throw std::runtime_error("backward failed on purpose");
    return grads;
  }
};

// A backward pass that throws partway must not leave DDP thinking a pass is
// still under way: the next pass is averaged as usual.
// Replicas that are not the same model are refused on every rank, naming
// the difference, before anything is broadcast (a broadcast of buffers of
// different sizes ends the process in Gloo's own thread); the group stays
// usable.
MULTIPROCESS_TEST(DdpTest, ReplicasOfDifferentModelsAreRefusedOnEveryRank, 2) {
  auto pg = group();
  for (const bool same_count : {true, false}) {
    torch::nn::Sequential model;
    if (same_count) {
      model->push_back(torch::nn::Linear(6, mp::rank() == 0 ? 16 : 32));
    } else {
      model->push_back(torch::nn::Linear(6, 16));
      if (mp::rank() == 1) model->push_back(torch::nn::Linear(16, 3));
    }
    try {
      ddp::DistributedDataParallel ddp_model(model.ptr(), pg);
      ADD_FAILURE() << "replicas of different models were taken";
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("rank 1's model has"), std::string::npos) << what;
      EXPECT_EQ(what.find("other dtypes or shapes") != std::string::npos, same_count) << what;
    }
  }
  at::Tensor t = at::full({4}, 1.0);
  pg->allreduce({t})->wait(absl::Seconds(30));
  EXPECT_TRUE(at::allclose(t, at::full({4}, 2.0)));
}

MULTIPROCESS_TEST(DdpTest, PassAfterAFailedBackwardIsStillAveraged, 2) {
  auto pg = group();
  torch::nn::Linear first(6, 16), last(16, 3);
  auto model = torch::nn::Sequential(first, last);
  ddp::DistributedDataParallel ddp_model(model.ptr(), pg);
  auto [x, y] = full_batch(0);
  const int r = mp::rank();
  auto forward = [&] {
    at::Tensor h = ThrowInBackward::apply(first->forward(x.narrow(0, 2 * r, 2)));
    return at::mse_loss(last->forward(h), y.narrow(0, 2 * r, 2));
  };
  g_throw_in_backward = true;
  EXPECT_THROW(forward().backward(), std::exception);
  g_throw_in_backward = false;
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  forward().backward();
  // Averaged: the same gradient on both ranks, though their data differ.
  for (const auto& p : model->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    at::Tensor lo = p.grad().clone(), hi = p.grad().clone();
    pg->allreduce({lo}, ddp::ReduceOp::kMin)->wait(absl::Seconds(30));
    pg->allreduce({hi}, ddp::ReduceOp::kMax)->wait(absl::Seconds(30));
    EXPECT_TRUE(at::equal(lo, hi)) << "the pass after the failed one was not averaged";
  }
}

MULTIPROCESS_TEST(DdpTest, EarlyBucketLaunchesBeforeBackwardEnds, 2) {
  auto pg = group();
  // 4 x 256x256 floats = 1 MiB... each layer 256 KiB: with a 0.3 MB cap
  // every layer is its own bucket.
  auto model = torch::nn::Sequential(torch::nn::Linear(256, 256), torch::nn::Linear(256, 256),
                                     torch::nn::Linear(256, 256), torch::nn::Linear(256, 256));
  ddp::DdpOptions options;
  options.bucket_cap_mb = 0.3;
  options.first_bucket_mb = 0.3;
  ddp::DistributedDataParallel ddp_model(model.ptr(), pg, options);
  const auto buckets = ddp_model.bucket_indices();
  EXPECT_GE(buckets.size(), 4u);
  // Reverse parameter order: the last layer's parameters come first.
  ASSERT_FALSE(buckets.empty());
  EXPECT_EQ(buckets[0][0], model->parameters().size() - 1);
  std::vector<std::string> events;
  ddp_model.set_event_observer([&](const std::string& e) { events.push_back(e); });
  at::mse_loss(model->forward(at::randn({4, 256})), at::randn({4, 256})).backward();
  // Parameter 0 (first layer's weight) gets its gradient last; bucket 0
  // (the last layer) must have been launched before that.
  auto launch0 = std::find(events.begin(), events.end(), "launch 0");
  auto grad0 = std::find(events.begin(), events.end(), "grad 0");
  ASSERT_NE(launch0, events.end());
  ASSERT_NE(grad0, events.end());
  EXPECT_LT(launch0 - events.begin(), grad0 - events.begin());
  EXPECT_EQ(events.back(), "done");
}

MULTIPROCESS_TEST(DdpTest, NoSyncUnusedParametersAndFp16Hook, 2) {
  auto pg = group();
  auto model = make_model();
  ddp::DdpOptions options;
  options.find_unused_parameters = true;
  ddp::DistributedDataParallel ddp_model(model.ptr(), pg, options);
  std::vector<std::string> events;
  ddp_model.set_event_observer([&](const std::string& e) { events.push_back(e); });
  const double r = mp::rank();
  at::Tensor x = at::full({1, 6}, r + 1);
  at::Tensor local_w0;  // this rank's gradient of the first weight, one pass
  {
    auto guard = ddp_model.no_sync();  // local accumulation only
    model->forward(x).sum().backward();
    local_w0 = model->parameters()[0].grad().clone();
  }
  EXPECT_TRUE(events.empty());
  // The ranks' gradients differ (their inputs do); their average, by a plain
  // allreduce, is what every averaged pass below must give.
  at::Tensor average_w0 = local_w0.clone();
  pg->allreduce({average_w0})->wait(absl::Seconds(30));
  average_w0.div_(2);
  EXPECT_FALSE(at::allclose(local_w0, average_w0)) << "the ranks' gradients must differ";
  at::Tensor local = model->parameters()[3].grad().clone();  // last bias: ones
  model->forward(x).sum().backward();
  // Average of the two ranks' accumulated gradients (two passes each).
  EXPECT_TRUE(at::allclose(model->parameters()[3].grad(), local * 2.0));
  EXPECT_TRUE(at::allclose(model->parameters()[0].grad(), average_w0 * 2.0, 1e-5, 1e-6));

  // A parameter that gets no gradient (only the last layer is used).
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  auto last = model[2]->as<torch::nn::Linear>();
  last->forward(at::full({1, 16}, r + 1)).sum().backward();
  EXPECT_TRUE(at::allclose(last->weight.grad(), at::full({3, 16}, 1.5)));

  ddp_model.register_comm_hook(ddp::fp16_compress_hook());
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  model->forward(x).sum().backward();
  at::Tensor fp16 = model->parameters()[0].grad().clone();
  ddp_model.register_comm_hook(ddp::allreduce_hook());
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  model->forward(x).sum().backward();
  EXPECT_TRUE(at::allclose(model->parameters()[0].grad(), average_w0, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(fp16, average_w0, 1e-2, 1e-2));
}

// The gradient sink (the seam for distributed autograd) gets every
// parameter's average exactly once; .grad then keeps the local gradient.
MULTIPROCESS_TEST(DdpTest, GradientSinkReceivesTheAveragesInsteadOfGrad, 2) {
  auto pg = group();
  auto model = make_model();
  ddp::DistributedDataParallel ddp_model(model.ptr(), pg);
  const auto params = model->parameters();
  std::vector<at::Tensor> received(params.size());
  ddp_model.set_gradient_sink([&](size_t k, const at::Tensor& p, const at::Tensor& avg) {
    ASSERT_LT(k, received.size());
    EXPECT_TRUE(p.is_same(params[k]));
    EXPECT_FALSE(received[k].defined()) << "parameter " << k << " delivered twice";
    received[k] = avg.clone();
  });
  const double r = mp::rank();
  at::Tensor x = at::full({1, 6}, r + 1);
  model->forward(x).sum().backward();
  for (size_t k = 0; k < params.size(); ++k) {
    ASSERT_TRUE(received[k].defined()) << "parameter " << k;
    at::Tensor expected = params[k].grad().clone();  // local
    pg->allreduce({expected}, ddp::ReduceOp::kAvg)->wait();
    EXPECT_TRUE(at::allclose(received[k], expected)) << "parameter " << k;
  }
  // The ranks' inputs differ, so the first layer's local gradient is not the average.
  EXPECT_FALSE(at::allclose(params[0].grad(), received[0]));

  ddp_model.set_gradient_sink(nullptr);  // back to writing .grad
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  model->forward(x).sum().backward();
  EXPECT_TRUE(at::allclose(params[0].grad(), received[0]));
}

// A bfloat16 model (the dtype most GPU training uses): DDP averages its
// bfloat16 gradients across the ranks into .grad.
MULTIPROCESS_TEST(DdpTest, Bfloat16ModelGradientsAreAveraged, 2) {
  auto pg = group();
  at::manual_seed(mp::rank());  // DDP makes rank 0's parameters everyone's
  auto model = make_model();
  model->to(at::kBFloat16);
  ddp::DistributedDataParallel ddp_model(model.ptr(), pg);
  const auto params = model->parameters();
  const double r = mp::rank();
  at::Tensor x = at::full({2, 6}, r + 1, at::kBFloat16);
  // Each rank's local gradients, from the same (broadcast) parameters.
  std::vector<at::Tensor> local, expected;
  {
    auto plain = make_model();
    plain->to(at::kBFloat16);
    for (size_t k = 0; k < params.size(); ++k) {
      plain->parameters()[k].set_data(params[k].detach().clone());
    }
    plain->forward(x).sum().backward();
    for (auto& p : plain->parameters()) {
      local.push_back(p.grad().clone());
      at::Tensor g = p.grad().clone();
      pg->allreduce({g}, ddp::ReduceOp::kAvg)->wait();
      expected.push_back(g);
    }
  }
  model->forward(x).sum().backward();
  for (size_t k = 0; k < params.size(); ++k) {
    ASSERT_TRUE(params[k].grad().defined()) << "parameter " << k;
    EXPECT_EQ(params[k].grad().scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::allclose(params[k].grad().to(at::kFloat), expected[k].to(at::kFloat), 1e-2,
                             1e-2))
        << "parameter " << k;
  }
  // The ranks' inputs differ, so the first layer's average is not its local gradient.
  EXPECT_FALSE(at::allclose(local[0].to(at::kFloat), expected[0].to(at::kFloat), 1e-2, 1e-2));
}


// init_process_group hosts a store: off loopback, with no token or TLS, it
// refuses to open one to anyone who can reach the port, unless told to.
TEST(InitProcessGroupTest, OffLoopbackItNeedsTheJobsSecretOrAllowInsecure) {
  if (mp::is_worker()) return;
  for (const char* name : {ddprpc::rpc::kAuthTokenEnv, ddprpc::rpc::kAuthTokenFileEnv,
                           ddprpc::rpc::kTlsCertEnv, ddprpc::rpc::kTlsKeyEnv,
                           ddprpc::rpc::kTlsCaEnv}) {
    ::unsetenv(name);
  }
  // 0.0.0.0: the store listens on every interface, and its clients reach
  // it through this host's own.
  const auto init = [] {
    return absl::StrCat("tcp://0.0.0.0:", ddprpc::rpc::pick_free_port());
  };
  ddp::ProcessGroupOptions options = group_options();
  options.timeout = absl::Seconds(20);
  try {
    ddp::init_process_group("gloo", init(), 0, 1, options);
    ADD_FAILURE() << "a group served its store on every interface with no secret";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 0 would serve the group's store at 0.0.0.0:"), std::string::npos)
        << what;
    EXPECT_NE(what.find("no authentication"), std::string::npos) << what;
  }
  for (const bool token : {true, false}) {
    ddp::ProcessGroupOptions allowed = options;
    if (token) {
      allowed.security.token = ddprpc::rpc::Security::random_token();
    } else {
      allowed.allow_insecure = true;
    }
    auto pg = ddp::init_process_group("gloo", init(), 0, 1, allowed);
    at::Tensor t = at::full({4}, 2.0);
    pg->allreduce({t})->wait(absl::Seconds(20));
    EXPECT_TRUE(at::allclose(t, at::full({4}, 2.0))) << "token " << token;
  }
}

// A process that holds a rank's place in a Gloo pair without the job's
// secret (as one that connects first to Gloo's listener while the group is
// set up would) cannot join: creating the group fails on both ranks, naming
// the pair, well within the group's timeout, and no collective runs. Here
// the stranger reaches the pair by rendezvousing through a store that asks
// for no proof; its own token is not the job's.
MULTIPROCESS_TEST(ProcessGroupTest, AProcessWithoutTheSecretCannotHoldAGlooPair, 2) {
  const std::string host = std::getenv("MASTER_ADDR");
  const int port = std::atoi(std::getenv("MASTER_PORT"));
  std::unique_ptr<ddprpc::rpc::StoreServer> server;
  if (mp::rank() == 0) server = ddprpc::rpc::StoreServer::start(host, port, ddprpc::rpc::Security{});
  ddprpc::rpc::Security security = ddprpc::rpc::Security::from_environment();
  ASSERT_TRUE(security.authenticated()) << "the launcher gives its workers a token";
  if (mp::rank() == 1) security.token = ddprpc::rpc::Security::random_token();
  auto store = std::make_shared<ddprpc::rpc::Store>(host, port, absl::Seconds(30), security);
  ddp::ProcessGroupOptions options = group_options();
  options.timeout = absl::Seconds(20);
  const absl::Time start = absl::Now();
  try {
    ddp::make_gloo_group(store, "stranger/", mp::rank(), 2, options);
    ADD_FAILURE() << "a group formed with a pair whose other end does not know the secret";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    const bool refused = what.find(absl::StrCat("Gloo pair with rank ", 1 - mp::rank(),
                                                " is not connected to the job's worker")) !=
                         std::string::npos;
    // Rank 1 may instead see rank 0 close the pair once rank 0 has refused
    // its proof (rank 0 sent its own first, so rank 1 can also refuse it).
    const bool closed = mp::rank() == 1 && what.find("got no proof from rank 0") != std::string::npos;
    EXPECT_TRUE(refused || closed) << what;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // Rank 0's store serves until rank 1 is done with it.
  if (mp::rank() == 1) store->set("stranger/done", "1");
  if (mp::rank() == 0) store->wait({"stranger/done"}, absl::Seconds(30));
}

// Two ranks with the same secret prove it to each other over every pair
// (both meshes) and then reduce; a signer's MAC is bound to the context it
// was made for.
MULTIPROCESS_TEST(ProcessGroupTest, MembersProveTheSecretOverTheirGlooPairs, 3) {
  auto rs = rank_store_at_master(absl::Seconds(30));
  ASSERT_TRUE(rs.store->authenticated());
  auto pg = ddp::make_gloo_group(rs.store, "members/", mp::rank(), 3, group_options());
  at::Tensor t = at::full({4}, double(mp::rank()));
  pg->allreduce({t})->wait();
  EXPECT_TRUE(at::allclose(t, at::full({4}, 3.0)));
  EXPECT_NE(rs.store->sign("a"), rs.store->sign("b"));
  EXPECT_EQ(rs.store->sign("a").size(), 64u);
  pg->barrier()->wait();
}

}  // namespace

namespace {

// Two ranks, each its own GPU, with rank-dependent data: every collective
// must combine what the other rank holds (a no-op backend fails each check).
void NcclTwoRanksBody() {
  auto pg = ddp::init_process_group("nccl");
  const double r = mp::rank();
  at::Tensor sum = at::full({1000}, r + 1), avg = at::full({1000}, r + 1);
  at::Tensor max = at::full({7}, r * 10), bcast = at::full({5}, r + 5);
  pg->allreduce({sum}, ddp::ReduceOp::kSum)->wait(absl::Seconds(60));
  EXPECT_TRUE(at::equal(sum, at::full({1000}, 3.0)));
  pg->allreduce({avg}, ddp::ReduceOp::kAvg)->wait(absl::Seconds(60));
  EXPECT_TRUE(at::allclose(avg, at::full({1000}, 1.5)));
  pg->allreduce({max}, ddp::ReduceOp::kMax)->wait(absl::Seconds(60));
  EXPECT_TRUE(at::equal(max, at::full({7}, 10.0)));
  pg->broadcast({bcast}, 1)->wait(absl::Seconds(60));
  EXPECT_TRUE(at::equal(bcast, at::full({5}, 6.0)));
  std::vector<at::Tensor> out = {at::empty({3}), at::empty({3})};
  pg->allgather(out, at::full({3}, r))->wait(absl::Seconds(60));
  EXPECT_TRUE(at::equal(out[0], at::zeros({3})));
  EXPECT_TRUE(at::equal(out[1], at::ones({3})));
  pg->barrier()->wait(absl::Seconds(60));
}

// Runs where two GPUs are visible; skipped elsewhere.
TEST(ProcessGroupNcclTest, TwoRanksCombineRankDependentData) {
  if (mp::is_worker()) return NcclTwoRanksBody();
  if (ddp::nccl_devices() < 2) {
    GTEST_SKIP() << "needs two GPUs visible to the NCCL backend (has " << ddp::nccl_devices() << ")";
  }
  ASSERT_EQ(0, mp::run_workers("ProcessGroupNcclTest.TwoRanksCombineRankDependentData", 2,
                               absl::Seconds(120)));
}

// Runs where a GPU is visible (the lent GPU machine); skipped elsewhere. At
// one rank every collective is the identity: this checks only that the
// backend starts, runs and ends; TwoRanksCombineRankDependentData checks
// the collectives.
TEST(ProcessGroupNcclTest, WorldSizeOne) {
  if (mp::is_worker()) return;
  if (!ddp::nccl_available()) GTEST_SKIP() << "no NCCL build or no visible GPU";
  auto pg = ddp::init_process_group("nccl", "tcp://127.0.0.1:" + std::to_string(29000 + getpid() % 1000), 0, 1);
  at::Tensor t = at::full({1000}, 3.0);
  pg->allreduce({t}, ddp::ReduceOp::kSum)->wait();
  EXPECT_TRUE(at::allclose(t, at::full({1000}, 3.0)));
  pg->allreduce({t}, ddp::ReduceOp::kAvg)->wait();
  EXPECT_TRUE(at::allclose(t, at::full({1000}, 3.0)));
  pg->broadcast({t}, 0)->wait();
  std::vector<at::Tensor> out = {at::empty({1000})};
  pg->allgather(out, t)->wait();
  EXPECT_TRUE(at::allclose(out[0], t));
  pg->barrier()->wait();
}

}  // namespace
