// Checkpoints of embedding shards (the hybrid model's tables on parameter
// servers) for elastic runs: a copy of a shard's weight with the iteration
// it was taken at and the optimizer steps it holds, kept as a file under a
// directory shared by the servers, or held in memory by another server (a
// replica), so that the shard outlives its server.
//
// File format (little-endian): "DDPRPCS1", then int64 shard, iteration,
// steps, rows, dim, then rows * dim float32 values. A file is written
// whole to a temporary name and renamed over the last one, so a reader sees
// one checkpoint or the one before, never part of one.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ddprpc::models {

struct ShardCheckpoint {
  int64_t shard = 0;
  int64_t iteration = 0;  // the training iteration it was taken at
  int64_t steps = 0;      // optimizer steps applied to the shard by then
  at::Tensor weight;      // float32 [rows, dim], contiguous
};

// A job's name in checkpoint files and replicas: 1..64 characters of
// [A-Za-z0-9_-] (it names a directory).
bool valid_job_name(const std::string& job);

// "<dir>/<job>/shard<shard>.ckpt".
std::string shard_file(const std::string& dir, const std::string& job, int64_t shard);

absl::Status write_shard_file(const std::string& dir, const std::string& job,
                              const ShardCheckpoint& checkpoint);

// The checkpoint of `shard`, which must have `rows` x `dim` values; an
// error names what is missing, short or of another shape.
absl::StatusOr<ShardCheckpoint> read_shard_file(const std::string& dir, const std::string& job,
                                                int64_t shard, int64_t rows, int64_t dim);

// Removes the checkpoint files of `job` under `dir`, and its directory.
void remove_shard_files(const std::string& dir, const std::string& job);

// Replicas this process holds for other servers: the newest of each
// (job, shard), at most kMaxReplicas in all, taking at most half of the
// machine's memory (other jobs' are dropped to make room; past either
// bound, ResourceExhausted). Thread-safe.
constexpr int kMaxReplicas = 4096;
absl::Status hold_replica(const std::string& job, ShardCheckpoint checkpoint);
std::optional<ShardCheckpoint> held_replica(const std::string& job, int64_t shard);
// Drops every replica of `job`.
void drop_replicas(const std::string& job);

}  // namespace ddprpc::models
