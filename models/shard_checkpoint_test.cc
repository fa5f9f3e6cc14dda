#include "models/shard_checkpoint.h"

#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/randn.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "models/hybrid_model.h"

namespace ddprpc::models {
namespace {

std::string temp_dir() {
  std::string pattern = absl::StrCat(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp",
                                     "/ckptXXXXXX");
  return ::mkdtemp(pattern.data());
}

ShardCheckpoint sample(int64_t shard, int64_t iteration, int64_t rows = 5, int64_t dim = 3) {
  return ShardCheckpoint{shard, iteration, iteration * 7, at::randn({rows, dim})};
}

TEST(ShardCheckpoint, JobNames) {
  EXPECT_TRUE(valid_job_name("hybrid0-0123abcd"));
  EXPECT_FALSE(valid_job_name(""));
  EXPECT_FALSE(valid_job_name("../etc"));
  EXPECT_FALSE(valid_job_name("a/b"));
  EXPECT_FALSE(valid_job_name(std::string(65, 'a')));
}

TEST(ShardCheckpoint, FileRoundTripAndReplacement) {
  const std::string dir = temp_dir();
  ShardCheckpoint first = sample(2, 10);
  ASSERT_TRUE(write_shard_file(dir, "job1", first).ok());
  ShardCheckpoint second = sample(2, 20);
  ASSERT_TRUE(write_shard_file(dir, "job1", second).ok());
  absl::StatusOr<ShardCheckpoint> read = read_shard_file(dir, "job1", 2, 5, 3);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->shard, 2);
  EXPECT_EQ(read->iteration, 20);
  EXPECT_EQ(read->steps, 140);
  EXPECT_TRUE(at::equal(read->weight, second.weight));
  // Another shard, another shape, another job: refused or missing.
  EXPECT_EQ(read_shard_file(dir, "job1", 3, 5, 3).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(read_shard_file(dir, "job1", 2, 6, 3).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(read_shard_file(dir, "job2", 2, 5, 3).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(read_shard_file(dir, "../job1", 2, 5, 3).ok());
  // The end of the job: its files and directory go, nothing else.
  ASSERT_TRUE(write_shard_file(dir, "job3", first).ok());
  remove_shard_files(dir, "job1");
  EXPECT_EQ(read_shard_file(dir, "job1", 2, 5, 3).status().code(), absl::StatusCode::kNotFound);
  struct stat st;
  EXPECT_NE(::stat(absl::StrCat(dir, "/job1").c_str(), &st), 0);
  EXPECT_TRUE(read_shard_file(dir, "job3", 2, 5, 3).ok());
}

// Writes of one shard at once (a slow one overtaken by the next) each
// leave a whole file, never a mix; the latest iteration stays, and an
// older one is not put back over it.
TEST(ShardCheckpoint, WritesOfOneShardAtOnceNeverMixAndTheLatestStays) {
  const std::string dir = temp_dir();
  constexpr int kWriters = 8;
  std::vector<ShardCheckpoint> checkpoints;
  for (int i = 1; i <= kWriters; ++i) checkpoints.push_back(sample(1, i, 512, 256));
  std::vector<std::thread> writers;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < kWriters; ++i) {
      writers.emplace_back([&, i] {
        const absl::Status s = write_shard_file(dir, "job", checkpoints[i]);
        // Refused only for an older iteration than the one there.
        EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kFailedPrecondition) << s;
      });
    }
    for (auto& t : writers) t.join();
    writers.clear();
    absl::StatusOr<ShardCheckpoint> read = read_shard_file(dir, "job", 1, 512, 256);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->iteration, kWriters);
    EXPECT_TRUE(at::equal(read->weight, checkpoints[kWriters - 1].weight)) << "a mixed file";
  }
  const absl::Status older = write_shard_file(dir, "job", sample(1, 3, 512, 256));
  EXPECT_EQ(older.code(), absl::StatusCode::kFailedPrecondition) << older;
  EXPECT_EQ(read_shard_file(dir, "job", 1, 512, 256)->iteration, kWriters);
  remove_shard_files(dir, "job");
  struct stat st;
  EXPECT_NE(::stat(absl::StrCat(dir, "/job").c_str(), &st), 0) << "files left behind";
}

TEST(ShardCheckpoint, DamagedFilesAreRefused) {
  const std::string dir = temp_dir();
  ASSERT_TRUE(write_shard_file(dir, "job", sample(0, 1)).ok());
  const std::string path = shard_file(dir, "job", 0);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto rewrite = [&path](const std::string& content) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << content;
  };
  rewrite(bytes.substr(0, bytes.size() - 4));  // short
  EXPECT_EQ(read_shard_file(dir, "job", 0, 5, 3).status().code(), absl::StatusCode::kDataLoss);
  rewrite(bytes + "x");  // long
  EXPECT_EQ(read_shard_file(dir, "job", 0, 5, 3).status().code(), absl::StatusCode::kDataLoss);
  std::string bad = bytes;
  bad[0] = 'X';  // not a checkpoint
  rewrite(bad);
  EXPECT_EQ(read_shard_file(dir, "job", 0, 5, 3).status().code(), absl::StatusCode::kDataLoss);
  rewrite(bytes.substr(0, 12));  // header cut
  EXPECT_EQ(read_shard_file(dir, "job", 0, 5, 3).status().code(), absl::StatusCode::kDataLoss);
  rewrite(bytes);
  EXPECT_TRUE(read_shard_file(dir, "job", 0, 5, 3).ok());
}

TEST(ShardCheckpoint, ReplicasKeepTheNewestAndAreBounded) {
  ASSERT_TRUE(hold_replica("jobA", sample(1, 20)).ok());
  ASSERT_TRUE(hold_replica("jobA", sample(1, 10)).ok());  // older: ignored
  ASSERT_TRUE(held_replica("jobA", 1).has_value());
  EXPECT_EQ(held_replica("jobA", 1)->iteration, 20);
  EXPECT_FALSE(held_replica("jobA", 2).has_value());
  EXPECT_FALSE(held_replica("jobB", 1).has_value());
  EXPECT_FALSE(hold_replica("bad/job", sample(1, 1)).ok());
  EXPECT_FALSE(hold_replica("jobA", ShardCheckpoint{3, 1, 1, at::randn({4})}).ok());

  // The table is bounded; a new job makes room from other jobs' replicas.
  drop_replicas("jobA");
  for (int i = 0; i < kMaxReplicas; ++i) {
    ASSERT_TRUE(hold_replica("jobC", sample(i, 1, 1, 1)).ok()) << i;
  }
  EXPECT_EQ(hold_replica("jobC", sample(kMaxReplicas, 1, 1, 1)).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(hold_replica("jobC", sample(0, 2, 1, 1)).ok());  // a newer one of a held shard
  EXPECT_TRUE(hold_replica("jobD", sample(0, 1, 1, 1)).ok());
  EXPECT_FALSE(held_replica("jobC", 0).has_value());
  drop_replicas("jobD");
  EXPECT_FALSE(held_replica("jobD", 0).has_value());
}

TEST(EmbeddingTableSteps, CountsOptimizerStepsAndRestores) {
  EmbeddingTable table(6, 4);
  EXPECT_EQ(table.steps(), 0);
  // In-place changes count (an optim::LocalOptimizer step makes one).
  for (int i = 0; i < 5; ++i) {
    torch::NoGradGuard no_grad;
    table.module()->weight.add_(1.0);
  }
  EXPECT_EQ(table.steps(), 5);
  auto [copy, steps] = table.snapshot();
  EXPECT_EQ(steps, 5);
  EXPECT_TRUE(at::equal(copy, table.module()->weight));

  EmbeddingTable restored(6, 4);
  restored.restore(copy, 9);
  EXPECT_EQ(restored.steps(), 9);
  EXPECT_TRUE(at::equal(restored.module()->weight, copy));
  {
    torch::NoGradGuard no_grad;
    restored.module()->weight.sub_(0.5);
  }
  EXPECT_EQ(restored.steps(), 10);
  EXPECT_THROW(restored.restore(at::randn({2, 2}), 1), std::invalid_argument);
}

}  // namespace
}  // namespace ddprpc::models
