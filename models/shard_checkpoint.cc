#include "models/shard_checkpoint.h"

#include <ATen/ops/empty.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <utility>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace ddprpc::models {
namespace {

constexpr char kMagic[8] = {'D', 'D', 'P', 'R', 'P', 'C', 'S', '1'};
constexpr int kHeaderWords = 5;  // shard, iteration, steps, rows, dim

// Rows * dim of a checkpoint, at most 2^31 values (8 GiB of float32).
constexpr int64_t kMaxValues = int64_t{1} << 31;

bool valid_shape(int64_t rows, int64_t dim) {
  return rows > 0 && dim > 0 && rows <= kMaxValues / dim;
}

absl::Status check(const ShardCheckpoint& c) {
  if (!c.weight.defined() || c.weight.dim() != 2 || c.weight.scalar_type() != at::kFloat ||
      !valid_shape(c.weight.size(0), c.weight.size(1))) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint of shard ", c.shard, ": not a float32 matrix of at most ",
                     kMaxValues, " values"));
  }
  return absl::OkStatus();
}

absl::Mutex replicas_mu;
// (job, shard) -> the newest replica.
std::map<std::pair<std::string, int64_t>, ShardCheckpoint>* replicas ABSL_GUARDED_BY(replicas_mu) =
    new std::map<std::pair<std::string, int64_t>, ShardCheckpoint>();

}  // namespace

bool valid_job_name(const std::string& job) {
  if (job.empty() || job.size() > 64) return false;
  for (char c : job) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  }
  return true;
}

std::string shard_file(const std::string& dir, const std::string& job, int64_t shard) {
  return absl::StrCat(dir, "/", job, "/shard", shard, ".ckpt");
}

absl::Status write_shard_file(const std::string& dir, const std::string& job,
                              const ShardCheckpoint& checkpoint) {
  if (!valid_job_name(job)) return absl::InvalidArgumentError("invalid job name");
  if (absl::Status ok = check(checkpoint); !ok.ok()) return ok;
  const std::string job_dir = absl::StrCat(dir, "/", job);
  if (::mkdir(job_dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::UnavailableError(
        absl::StrCat("cannot create ", job_dir, ": ", std::strerror(errno)));
  }
  const at::Tensor w = checkpoint.weight.contiguous();
  const std::string path = shard_file(dir, job, checkpoint.shard);
  const std::string tmp = absl::StrCat(path, ".tmp", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    const int64_t header[kHeaderWords] = {checkpoint.shard, checkpoint.iteration, checkpoint.steps,
                                          w.size(0), w.size(1)};
    out.write(kMagic, sizeof(kMagic));
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
    out.write(static_cast<const char*>(w.data_ptr()),
              static_cast<std::streamsize>(w.numel() * sizeof(float)));
    out.flush();
    if (!out) {
      ::unlink(tmp.c_str());
      return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path, ": ", why));
  }
  return absl::OkStatus();
}

absl::StatusOr<ShardCheckpoint> read_shard_file(const std::string& dir, const std::string& job,
                                                int64_t shard, int64_t rows, int64_t dim) {
  if (!valid_job_name(job)) return absl::InvalidArgumentError("invalid job name");
  if (!valid_shape(rows, dim)) return absl::InvalidArgumentError("invalid shard shape");
  const std::string path = shard_file(dir, job, shard);
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("no checkpoint file ", path));
  char magic[sizeof(kMagic)];
  int64_t header[kHeaderWords];
  in.read(magic, sizeof(magic));
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  if (!in || std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(path, " is not a shard checkpoint"));
  }
  if (header[0] != shard || header[3] != rows || header[4] != dim || header[1] < 0 ||
      header[2] < 0) {
    return absl::DataLossError(absl::StrCat(path, " holds shard ", header[0], " of ", header[3],
                                            "x", header[4], ", not shard ", shard, " of ", rows,
                                            "x", dim));
  }
  ShardCheckpoint c;
  c.shard = shard;
  c.iteration = header[1];
  c.steps = header[2];
  c.weight = at::empty({rows, dim}, at::kFloat);
  in.read(static_cast<char*>(c.weight.data_ptr()),
          static_cast<std::streamsize>(rows * dim * sizeof(float)));
  if (!in || in.peek() != std::char_traits<char>::eof()) {
    return absl::DataLossError(absl::StrCat(path, " is not ", rows, "x", dim, " values long"));
  }
  return c;
}

void remove_shard_files(const std::string& dir, const std::string& job) {
  if (!valid_job_name(job) || dir.empty()) return;
  const std::string job_dir = absl::StrCat(dir, "/", job);
  if (DIR* d = ::opendir(job_dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.rfind("shard", 0) == 0 && name.find(".ckpt") != std::string::npos) {
        ::unlink(absl::StrCat(job_dir, "/", name).c_str());
      }
    }
    ::closedir(d);
  }
  ::rmdir(job_dir.c_str());
}

absl::Status hold_replica(const std::string& job, ShardCheckpoint checkpoint) {
  if (!valid_job_name(job)) return absl::InvalidArgumentError("invalid job name");
  if (absl::Status ok = check(checkpoint); !ok.ok()) return ok;
  checkpoint.weight = checkpoint.weight.contiguous();
  absl::MutexLock lock(&replicas_mu);
  const auto key = std::make_pair(job, checkpoint.shard);
  auto it = replicas->find(key);
  if (it != replicas->end()) {
    if (it->second.iteration <= checkpoint.iteration) it->second = std::move(checkpoint);
    return absl::OkStatus();
  }
  if (replicas->size() >= static_cast<size_t>(kMaxReplicas)) {
    // Room from other jobs' replicas, never from this job's.
    for (auto other = replicas->begin(); other != replicas->end();) {
      other = other->first.first != job ? replicas->erase(other) : std::next(other);
    }
    if (replicas->size() >= static_cast<size_t>(kMaxReplicas)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("this server holds ", kMaxReplicas, " replicas of job ", job));
    }
  }
  replicas->emplace(key, std::move(checkpoint));
  return absl::OkStatus();
}

std::optional<ShardCheckpoint> held_replica(const std::string& job, int64_t shard) {
  absl::MutexLock lock(&replicas_mu);
  auto it = replicas->find({job, shard});
  if (it == replicas->end()) return std::nullopt;
  return it->second;
}

void drop_replicas(const std::string& job) {
  absl::MutexLock lock(&replicas_mu);
  for (auto it = replicas->begin(); it != replicas->end();) {
    it = it->first.first == job ? replicas->erase(it) : std::next(it);
  }
}

}  // namespace ddprpc::models
