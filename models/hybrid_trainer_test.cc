// The HybridModel trainer library across real processes on loopback: typed
// results (one timing per measured iteration, a loss per iteration), DDP
// keeping the trainers' dense stacks identical, a learnable target learned,
// a zero learning rate leaving the tables alone, a master with other
// options refused by every trainer, and one trainer's run equal to the same
// training computed in a single process.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/equal.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "models/hybrid_model.h"
#include "models/hybrid_trainer.h"
#include "rpc/rpc.h"
#include "rpc/rref/rref.h"
#include "tests/multiprocess.h"

namespace rpc = ddprpc::rpc;
namespace mp = ddprpc::testing;
namespace models = ddprpc::models;

namespace {

using models::HybridTrainerOptions;
using models::HybridWorld;

// Parameters of make_dense(fc_in).
int64_t dense_size(int64_t fc_in) {
  return fc_in * 256 + 256 + 256 * 128 + 128 + 128 * 64 + 64 + 64 * 32 + 32 + 32 * 8 + 8;
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

TEST(HybridTrainerOptionsTest, InvalidOptionsAreNamed) {
  HybridTrainerOptions o;
  EXPECT_EQ(o.invalid(), "");
  o.trainers = 0;
  EXPECT_NE(o.invalid(), "");
  o = HybridTrainerOptions();
  o.warmup = -1;
  EXPECT_NE(o.invalid(), "");
  o = HybridTrainerOptions();
  o.learnable_target = true;
  o.num_embeddings = 7;
  EXPECT_NE(o.invalid(), "");
  o = HybridTrainerOptions();
  o.kills = {{o.trainers, 0}};
  EXPECT_NE(o.invalid(), "");
  o.kills = {{0, o.warmup + o.iters}};
  EXPECT_NE(o.invalid(), "");
  EXPECT_THROW(models::run_hybrid_training(o), std::invalid_argument);
}

TEST(HybridTrainerOptionsTest, WorkloadNamesEveryFieldATrainerUses) {
  const HybridTrainerOptions base;
  auto differs = [&base](auto change) {
    HybridTrainerOptions o = base;
    change(o);
    return o.workload() != base.workload();
  };
  EXPECT_TRUE(differs([](auto& o) { o.iters = 7; }));
  EXPECT_TRUE(differs([](auto& o) { o.lr = 0.5; }));
  EXPECT_TRUE(differs([](auto& o) { o.seed = 2; }));
  EXPECT_TRUE(differs([](auto& o) { o.sparse = true; }));
  EXPECT_TRUE(differs([](auto& o) { o.sequential_lookups = true; }));
  EXPECT_TRUE(differs([](auto& o) { o.dense_kernel = models::DenseKernel::kAten; }));
  EXPECT_TRUE(differs([](auto& o) { o.learnable_target = true; }));
  EXPECT_TRUE(differs([](auto& o) { o.elastic = true; }));
  EXPECT_TRUE(differs([](auto& o) { o.kills = {{0, 1}}; }));
  // The master's own choices do not concern trainers.
  EXPECT_FALSE(differs([](auto& o) { o.fetch_tables = true; }));
}

TEST(HybridTrainerOptionsTest, WorldNamesRanks) {
  const HybridWorld world(2, 3);
  EXPECT_EQ(world.size(), 6);
  EXPECT_EQ(world.name(1), "trainer1");
  EXPECT_EQ(world.name(2), "ps0");
  EXPECT_EQ(world.name(4), "ps2");
  EXPECT_EQ(world.name(5), "master");
  EXPECT_TRUE(world.is_master(5));
  EXPECT_FALSE(world.is_ps(5));
}

TEST(HybridTrainerOptionsTest, BatchesFollowTheSeedAndTheLearnableTarget) {
  HybridTrainerOptions o;
  o.num_embeddings = 100;
  o.learnable_target = true;
  std::mt19937_64 rng(models::derived_seed(o.seed, 0));
  const auto batches = models::make_batches(o, rng);
  ASSERT_EQ(batches.size(), 10u);
  for (const auto& b : batches) {
    const int64_t k = b.indices.size(0), bags = b.offsets.size(0);
    EXPECT_GE(k, 20);
    EXPECT_LE(k, 50);
    ASSERT_EQ(b.targets.size(0), bags);
    EXPECT_EQ(b.offsets[0].item<int64_t>(), 0);
    for (int64_t bag = 0; bag < bags; ++bag) {
      const int64_t begin = b.offsets[bag].item<int64_t>();
      const int64_t end = bag + 1 < bags ? b.offsets[bag + 1].item<int64_t>() : k;
      EXPECT_GE(end - begin, 1);
      EXPECT_LE(end - begin, 10);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t index = b.indices[i].item<int64_t>();
        EXPECT_LT(index, 100);
        EXPECT_EQ(index % models::kHybridClasses, b.targets[bag].item<int64_t>());
      }
    }
  }
  std::mt19937_64 again(models::derived_seed(o.seed, 0));
  EXPECT_TRUE(at::equal(models::make_batches(o, again)[0].indices, batches[0].indices));
  EXPECT_NE(models::derived_seed(1, 0), models::derived_seed(1, 1));
  EXPECT_NE(models::derived_seed(1, 0), models::derived_seed(2, 0));
}

// What this process's trainer reported, in order.
absl::Mutex progress_mu;
std::vector<models::TrainerProgress> progress ABSL_GUARDED_BY(progress_mu);

void record(const models::TrainerProgress& p) {
  absl::MutexLock lock(&progress_mu);
  progress.push_back(p);
}

// RRefs this worker owns that are still referenced somewhere.
int64_t owned_here() { return static_cast<int64_t>(rpc::owned_rrefs(*rpc::current_agent())); }
DDPRPC_REGISTER_FUNCTION(owned_here);

// Runs the body of a world's rank: a trainer serves `options` (recording
// its progress), every rank joins, the master runs `master`.
template <typename Master>
void play(const HybridTrainerOptions& options, Master master,
          const models::HybridServerOptions& server = {}) {
  at::set_num_threads(1);
  const HybridWorld world(options);
  const int rank = mp::rank();
  std::unique_ptr<models::HybridTrainerService> service;
  std::unique_ptr<models::HybridServerService> server_service;
  if (world.is_trainer(rank)) {
    service = std::make_unique<models::HybridTrainerService>(options, record);
  }
  if (world.is_ps(rank)) server_service = std::make_unique<models::HybridServerService>(server);
  rpc::init_rpc(world.name(rank), rank, world.size(), mp::backend_options());
  if (world.is_master(rank)) master();
  rpc::shutdown();
}

HybridTrainerOptions small(int trainers, int ps) {
  HybridTrainerOptions o;
  o.trainers = trainers;
  o.ps = ps;
  o.num_embeddings = 64;
  o.embedding_dim = 8;
  o.iters = 4;
  o.warmup = 1;
  o.batches_per_iter = 3;
  o.seed = 7;
  o.dense_kernel = models::DenseKernel::kAten;
  o.run_timeout = absl::Seconds(120);
  o.collective_timeout = absl::Seconds(60);
  o.same_host_allreduce = !mp::network_paths_only();
  return o;
}

// The master's run of elastic `o`, returning every trainer's dense stack;
// a lost or joining worker may not hold it up past `bound`.
models::HybridRunResult run_elastic(HybridTrainerOptions o, absl::Duration bound) {
  o.return_dense_parameters = true;
  const absl::Time start = absl::Now();
  models::HybridRunResult r = models::run_hybrid_training(o);
  EXPECT_LT(absl::Now() - start, bound);
  return r;
}

// An elastic run of `iters` iterations (no warm-up) on a learnable target.
HybridTrainerOptions elastic_run(int trainers, int ps, int iters) {
  HybridTrainerOptions o = small(trainers, ps);
  o.learnable_target = true;
  o.iters = iters;
  o.warmup = 0;
  o.lr = 0.1;
  o.elastic = true;
  o.collective_timeout = absl::Seconds(20);
  return o;
}

MULTIPROCESS_TEST_WITH_TIMEOUT(HybridTrainerTest, TwoTrainersUnderDdp, 4, absl::Seconds(300)) {
  const HybridTrainerOptions options = small(2, 1);
  play(options, [&options] {
    // Random targets: the timings and losses of every trainer, and the
    // dense stacks DDP kept identical.
    HybridTrainerOptions o = options;
    o.return_dense_parameters = true;
    const models::HybridRunResult r = models::run_hybrid_training(o);
    ASSERT_EQ(r.trainers.size(), 2u);
    for (const auto& t : r.trainers) {
      ASSERT_EQ(t.seconds.size(), 4u);
      ASSERT_EQ(t.examples.size(), 4u);
      ASSERT_EQ(t.losses.size(), 5u);
      double total = 0;
      for (size_t i = 0; i < t.seconds.size(); ++i) {
        EXPECT_GT(t.seconds[i], 0);
        total += t.seconds[i];
        // 3 batches of 20..50 indices, bags of 1..10 of them.
        EXPECT_GE(t.examples[i], 6);
        EXPECT_LE(t.examples[i], 150);
      }
      EXPECT_LE(total, r.wall_s);
      for (double loss : t.losses) {
        EXPECT_TRUE(std::isfinite(loss));
        EXPECT_GT(loss, 0);
      }
      EXPECT_GT(t.forward_ms, 0);
      EXPECT_GT(t.backward_ms, 0);
      EXPECT_GT(t.step_ms, 0);
      ASSERT_TRUE(t.dense_parameters.defined());
      EXPECT_EQ(t.dense_parameters.numel(), dense_size(8));
    }
    EXPECT_TRUE(at::equal(r.trainers[0].dense_parameters, r.trainers[1].dense_parameters))
        << "DDP left the dense stacks apart by up to "
        << (r.trainers[0].dense_parameters - r.trainers[1].dense_parameters).abs().max().item<double>();
    // The trainers' data differ (their own seeds).
    EXPECT_NE(r.trainers[0].losses, r.trainers[1].losses);
  });
  // Every trainer reported the start and each iteration of the one run.
  if (HybridWorld(options).is_trainer(mp::rank())) {
    absl::MutexLock lock(&progress_mu);
    ASSERT_EQ(progress.size(), 6u);
    for (int i = 0; i < 6; ++i) {
      EXPECT_EQ(progress[i].iteration, i);
      EXPECT_EQ(progress[i].total, 5);
      EXPECT_EQ(progress[i].rank, mp::rank());
      if (i > 0) {
        EXPECT_EQ(progress[i].measured, i > 1);
      }
    }
  }
}

// Elastic: trainer1 of three dies as it starts its third iteration. The
// survivors drop the batch they were in, go on as a group of two in epoch 2
// with identical dense stacks, and still learn; the master reports trainer1
// lost instead of failing.
MULTIPROCESS_TEST_WITH_TIMEOUT(HybridTrainerTest, ElasticTrainersGoOnWithoutALostOne, 5,
                               absl::Seconds(300)) {
  HybridTrainerOptions options = elastic_run(3, 1, 6);
  options.kills = {{1, 2}};
  play(options, [&options] {
    const models::HybridRunResult r = run_elastic(options, absl::Seconds(60));
    ASSERT_EQ(r.trainers.size(), 3u);
    EXPECT_EQ(r.epoch, 2);
    EXPECT_EQ(r.lost_trainers, std::vector<int>{1});
    EXPECT_TRUE(r.trainers[1].lost);
    EXPECT_NE(r.trainers[1].lost_reason.find("trainer1"), std::string::npos)
        << r.trainers[1].lost_reason;
    EXPECT_TRUE(r.trainers[1].seconds.empty());
    for (int t : {0, 2}) {
      const auto& s = r.trainers[t];
      EXPECT_FALSE(s.lost);
      EXPECT_EQ(s.epoch, 2);
      EXPECT_EQ(s.dropped_batches, 1) << "trainer" << t;
      ASSERT_EQ(s.losses.size(), 6u);
      EXPECT_LT(s.losses.back(), s.losses.front()) << "trainer" << t << " did not learn";
    }
    EXPECT_TRUE(at::equal(r.trainers[0].dense_parameters, r.trainers[2].dense_parameters))
        << "the survivors' dense stacks differ";
    // Once the run is over nothing references what the server owns: the
    // lost trainer's forks (of the tables, of its optimizer there) were
    // released for it.
    int64_t owned = -1;
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while ((owned = rpc::rpc_sync<int64_t>("ps0", "owned_here")) != 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_EQ(owned, 0) << "RRefs ps0 still owns after the run";
  });
}

// Elastic: ps1 of two dies as trainer0 starts the fourth iteration; the
// shards were checkpointed before the first and at the third. The master
// restores shard 1 on ps0 from that checkpoint (`source`: a replica ps0
// holds, or a file under the servers' checkpoint directory), the trainers
// re-bind to it, drop the batch they were in and still learn, and the
// updates lost are counted: about one iteration of both trainers' steps.
void lose_a_server(bool replicate, const std::string& dir, const std::string& source) {
  HybridTrainerOptions options = elastic_run(2, 2, 6);
  options.checkpoint_every = 2;
  options.replicate_checkpoints = replicate;
  options.kills = {{1, 3, HybridTrainerOptions::Role::kPs}};
  play(
      options,
      [&options, &source, &dir] {
        HybridTrainerOptions o = options;
        o.fetch_tables = true;
        const models::HybridRunResult r = run_elastic(o, absl::Seconds(60));
        EXPECT_EQ(r.epoch, 2);
        EXPECT_TRUE(r.lost_trainers.empty());
        ASSERT_EQ(r.restores.size(), 1u);
        const models::ShardRestore& restore = r.restores[0];
        EXPECT_EQ(restore.shard, 1);
        EXPECT_EQ(restore.lost_server, "ps1");
        EXPECT_EQ(restore.restored_on, "ps0");
        EXPECT_EQ(restore.source, source);
        EXPECT_EQ(restore.epoch, 2);
        EXPECT_EQ(restore.checkpoint_iteration, 2);
        // Iteration 2 of both trainers (3 batches each), and part of the
        // third at most.
        EXPECT_GE(restore.updates_lost, 3);
        EXPECT_LE(restore.updates_lost, 2 * 3 + 2 * 3);
        // Both shards before the first iteration and at the third; at the
        // fifth, both live on ps0, which has no other server to replicate
        // to (a file is kept all the same).
        EXPECT_EQ(r.checkpoints, source == "file" ? 2 + 2 + 2 : 2 + 2);
        for (int t : {0, 1}) {
          const auto& s = r.trainers[t];
          EXPECT_FALSE(s.lost);
          EXPECT_EQ(s.epoch, 2);
          // The batch its call to ps1 failed in, and the other trainer's
          // when that came one batch later.
          EXPECT_GE(s.dropped_batches, 1) << "trainer" << t;
          EXPECT_LE(s.dropped_batches, 2) << "trainer" << t;
          ASSERT_EQ(s.losses.size(), 6u);
          EXPECT_LT(s.losses.back(), s.losses.front()) << "trainer" << t << " did not learn";
        }
        EXPECT_TRUE(at::equal(r.trainers[0].dense_parameters, r.trainers[1].dense_parameters))
            << "the trainers' dense stacks differ";
        ASSERT_EQ(r.tables_after.size(), 2u);
        EXPECT_EQ(r.tables_after[1].sizes(), (std::vector<int64_t>{64, 8}));
        EXPECT_FALSE(at::equal(r.tables_before[1], r.tables_after[1]));
        // The run's checkpoint files went with it.
        if (!dir.empty()) {
          std::error_code error;
          for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
            EXPECT_NE(entry.path().filename().string().rfind("hybrid", 0), 0u) << entry.path();
          }
        }
      },
      models::HybridServerOptions{dir, /*accept_injected_faults=*/true});
}

// Elastic: trainer1 of two dies as it starts its third iteration; trainer2,
// a standby in the world from the start, is called to join at the fourth,
// admitted at the start of that one or a later one, takes trainer0's dense
// stack and trains with it to the end.
MULTIPROCESS_TEST_WITH_TIMEOUT(HybridTrainerTest, ElasticStandbyJoinsAndTrains, 5,
                               absl::Seconds(300)) {
  HybridTrainerOptions options = elastic_run(2, 1, 16);
  options.kills = {{1, 2}};
  options.adds = {{3}};
  play(options, [&options] {
    const models::HybridRunResult r = run_elastic(options, absl::Seconds(60));
    ASSERT_EQ(r.trainers.size(), 3u);
    EXPECT_EQ(r.lost_trainers, std::vector<int>{1});
    // 1 start, 2 without trainer1, 3 trainer2 joining, 4 admitted.
    EXPECT_EQ(r.epoch, 4);
    const auto& joined = r.trainers[2];
    EXPECT_TRUE(joined.joined);
    EXPECT_FALSE(joined.lost);
    // Admitted at the first boundary after it asked (the start of its
    // iteration itself, when it asked before trainer0 looked): how many
    // iterations pass meanwhile depends on the machine (these take
    // milliseconds).
    EXPECT_GE(joined.first_iteration, 3);
    EXPECT_LE(joined.first_iteration, 15);
    EXPECT_EQ(joined.losses.size(), static_cast<size_t>(16 - joined.first_iteration));
    EXPECT_EQ(joined.seconds.size(), joined.losses.size());
    EXPECT_EQ(joined.epoch, 4);
    EXPECT_EQ(r.trainers[0].losses.size(), 16u);
    EXPECT_TRUE(at::equal(r.trainers[0].dense_parameters, joined.dense_parameters))
        << "the joined trainer's dense stack differs from trainer0's";
    EXPECT_LT(r.trainers[0].losses.back(), r.trainers[0].losses.front());
  });
}

// A standby called to join at the last iteration is admitted only if it
// asks before trainer0 looks at that same boundary (a standby may be
// admitted at the start of the iteration it is called at); no boundary
// follows. Most often it is not, and the run ends without it: either way
// the run ends normally and reports which. Before it, ps0 (no server
// options) refuses an injected fault.
MULTIPROCESS_TEST_WITH_TIMEOUT(HybridTrainerTest, ElasticStandbyTheRunEndsWithout, 4,
                               absl::Seconds(300)) {
  HybridTrainerOptions options = small(1, 1);
  options.iters = 3;
  options.warmup = 0;
  options.elastic = true;
  options.adds = {{2}};
  play(options, [&options] {
    // A server that did not accept injected faults refuses to be ended.
    try {
      rpc::rpc_sync<void>("ps0", "ddprpc.models.hybrid_trainer.die", std::string("by a test"));
      ADD_FAILURE() << "ps0 accepted an injected fault";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("accepts no injected faults"), std::string::npos)
          << e.what();
    }
    const models::HybridRunResult r = run_elastic(options, absl::Seconds(30));
    ASSERT_EQ(r.trainers.size(), 2u);
    EXPECT_TRUE(r.trainers[0].joined);
    EXPECT_EQ(r.trainers[0].seconds.size(), 3u);
    const auto& standby = r.trainers[1];
    EXPECT_FALSE(standby.lost);
    if (standby.joined) {
      EXPECT_EQ(standby.first_iteration, 2);
      EXPECT_EQ(standby.seconds.size(), 1u);
    } else {
      EXPECT_TRUE(standby.seconds.empty());
    }
  });
}

MULTIPROCESS_TEST_WITH_TIMEOUT(HybridTrainerTest, ElasticServerLostIsRestoredFromAReplica, 5,
                               absl::Seconds(300)) {
  lose_a_server(/*replicate=*/true, "", "replica");
}

MULTIPROCESS_TEST_WITH_TIMEOUT(HybridTrainerTest, ElasticServerLostIsRestoredFromAFile, 5,
                               absl::Seconds(300)) {
  // Every rank of the test shares the directory (its parent's TEST_TMPDIR).
  const char* tmp = std::getenv("TEST_TMPDIR");
  lose_a_server(/*replicate=*/false, tmp != nullptr ? tmp : "/tmp", "file");
}

MULTIPROCESS_TEST_WITH_TIMEOUT(HybridTrainerTest, LearnsALearnableTargetAndRefusesOtherOptions, 4,
                               absl::Seconds(300)) {
  HybridTrainerOptions options = small(2, 1);
  options.learnable_target = true;
  options.iters = 10;
  options.warmup = 0;
  options.lr = 0.1;
  play(options, [&options] {
    HybridTrainerOptions o = options;
    o.fetch_tables = true;
    const models::HybridRunResult learned = models::run_hybrid_training(o);
    ASSERT_EQ(learned.trainers.size(), 2u);
    std::vector<double> first, last;
    for (const auto& t : learned.trainers) {
      ASSERT_EQ(t.losses.size(), 10u);
      first.push_back(t.losses.front());
      last.push_back(t.losses.back());
    }
    EXPECT_GT(mean(first), 1.5);  // ~ln(8) before any training
    EXPECT_LT(mean(last), 0.9 * mean(first));
    ASSERT_EQ(learned.tables_before.size(), 1u);
    ASSERT_EQ(learned.tables_after.size(), 1u);
    EXPECT_EQ(learned.tables_before[0].sizes(), (std::vector<int64_t>{64, 8}));
    EXPECT_FALSE(at::equal(learned.tables_before[0], learned.tables_after[0]));

    // A master whose workload differs: every trainer refuses, by name.
    o.iters = 3;
    try {
      models::run_hybrid_training(o);
      ADD_FAILURE() << "trainers accepted a master with other options";
    } catch (const models::HybridTrainingError& e) {
      ASSERT_EQ(e.failures().size(), 2u) << e.what();
      for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(e.failures()[r].trainer, r);
        EXPECT_NE(e.failures()[r].message.find("was started with other options"), std::string::npos)
            << e.failures()[r].message;
      }
    }
  });
}

// The run of one trainer, computed again in this process: the tables and
// dense stack from their derived seeds, the trainer's batches, SGD on every
// parameter. Returns the mean loss per iteration; leaves the parameters in
// *tables and *dense.
std::vector<double> train_locally(const HybridTrainerOptions& o, std::vector<at::Tensor>* tables,
                                  at::Tensor* dense) {
  std::vector<std::unique_ptr<models::EmbeddingTable>> shards;
  for (int i = 0; i < o.ps; ++i) {
    at::manual_seed(models::derived_seed(o.seed, o.trainers + i));
    shards.push_back(std::make_unique<models::EmbeddingTable>(o.num_embeddings, o.embedding_dim));
  }
  at::manual_seed(models::derived_seed(o.seed, 0));
  torch::nn::Sequential stack = models::make_dense(o.ps * o.embedding_dim, o.dense_kernel);
  std::vector<at::Tensor> params;
  for (auto& s : shards) params.push_back(s->module()->weight);
  for (const auto& p : stack->parameters()) params.push_back(p);
  std::mt19937_64 rng(models::derived_seed(o.seed, 0));
  std::vector<double> losses;
  for (int it = 0; it < o.iters + o.warmup; ++it) {
    double sum = 0;
    for (const auto& b : models::make_batches(o, rng)) {
      std::vector<at::Tensor> embedded;
      for (auto& s : shards) embedded.push_back(s->forward(b.indices, b.offsets));
      at::Tensor loss = at::cross_entropy_loss(stack->forward(at::cat(embedded, 1)), b.targets);
      sum += loss.item<double>();
      loss.backward();
      at::NoGradGuard no_grad;
      for (auto& p : params) {
        p.add_(p.grad(), -o.lr);
        p.mutable_grad() = at::Tensor();
      }
    }
    losses.push_back(sum / o.batches_per_iter);
  }
  tables->clear();
  for (auto& s : shards) tables->push_back(s->module()->weight.detach().clone());
  std::vector<at::Tensor> flat;
  for (const auto& p : stack->parameters()) flat.push_back(p.detach().reshape({-1}));
  *dense = at::cat(flat);
  return losses;
}

MULTIPROCESS_TEST_WITH_TIMEOUT(HybridTrainerTest, OneTrainerTrainsAsASingleProcessWould, 4,
                               absl::Seconds(300)) {
  HybridTrainerOptions options = small(1, 2);
  options.num_embeddings = 40;
  options.embedding_dim = 4;
  options.iters = 3;
  options.batches_per_iter = 2;
  options.lr = 0.1;
  play(options, [&options] {
    HybridTrainerOptions o = options;
    o.fetch_tables = true;
    o.return_dense_parameters = true;
    const models::HybridRunResult r = models::run_hybrid_training(o);
    ASSERT_EQ(r.trainers.size(), 1u);
    std::vector<at::Tensor> tables;
    at::Tensor dense;
    const std::vector<double> losses = train_locally(o, &tables, &dense);
    ASSERT_EQ(r.trainers[0].losses.size(), losses.size());
    for (size_t i = 0; i < losses.size(); ++i) {
      EXPECT_NEAR(r.trainers[0].losses[i], losses[i], 1e-5 * std::abs(losses[i])) << "iteration " << i;
    }
    ASSERT_EQ(r.tables_after.size(), 2u);
    for (int i = 0; i < 2; ++i) {
      EXPECT_TRUE(at::allclose(r.tables_after[i], tables[i], 1e-4, 1e-6)) << "ps" << i;
    }
    EXPECT_TRUE(at::allclose(r.trainers[0].dense_parameters, dense, 1e-4, 1e-6));
    // Seeded anew each run: the same options train the same way again.
    const models::HybridRunResult again = models::run_hybrid_training(o);
    EXPECT_EQ(again.trainers[0].losses, r.trainers[0].losses);
    EXPECT_TRUE(at::equal(again.tables_before[0], r.tables_before[0]));
  });
}

}  // namespace
