#include "models/shard_checkpoint.h"

#include <ATen/ops/empty.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <utility>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
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
int64_t replica_bytes ABSL_GUARDED_BY(replicas_mu) = 0;  // of their weights

int64_t weight_bytes(const ShardCheckpoint& c) {
  return c.weight.numel() * static_cast<int64_t>(sizeof(float));
}

// What the replicas may take in all: half of this machine's memory.
int64_t max_replica_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return int64_t{8} << 30;
  return static_cast<int64_t>(pages) * page / 2;
}

}  // namespace

bool valid_job_name(const std::string& job) {
  if (job.empty() || job.size() > 64) return false;
  for (char c : job) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  }
  return true;
}

namespace {

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t put = ::write(fd, p, n);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    p += put;
    n -= static_cast<size_t>(put);
  }
  return true;
}

// The iteration of the checkpoint of `shard` at `path`; -1 when there is
// none (or not one of that shard).
int64_t iteration_in(const std::string& path, int64_t shard) {
  std::ifstream in(path, std::ios::binary);
  char magic[sizeof(kMagic)];
  int64_t header[kHeaderWords];
  in.read(magic, sizeof(magic));
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  if (!in || std::memcmp(magic, kMagic, sizeof(kMagic)) != 0 || header[0] != shard) return -1;
  return header[1];
}

}  // namespace

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
  // A temporary file of this call's own: writes of the same shard at once
  // (a slow one overtaken by the next) cannot mix their bytes.
  std::string tmp = path + ".tmpXXXXXX";
  const int fd = ::mkostemp(tmp.data(), O_CLOEXEC);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("cannot create a file in ", job_dir, ": ",
                                               std::strerror(errno)));
  }
  const int64_t header[kHeaderWords] = {checkpoint.shard, checkpoint.iteration, checkpoint.steps,
                                        w.size(0), w.size(1)};
  bool written = write_all(fd, kMagic, sizeof(kMagic)) &&
                 write_all(fd, header, sizeof(header)) &&
                 write_all(fd, w.data_ptr(), static_cast<size_t>(w.numel()) * sizeof(float));
  const int write_errno = errno;
  written = ::close(fd) == 0 && written;
  if (!written) {
    ::unlink(tmp.c_str());
    return absl::UnavailableError(
        absl::StrCat("cannot write ", tmp, ": ", std::strerror(write_errno)));
  }
  // Under the shard's lock (between processes too), and never over a
  // later iteration: a writer that was stopped or slow does not put an
  // older checkpoint back.
  const std::string lock_path = path + ".lock";
  const int lock = ::open(lock_path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  if (lock < 0 || ::flock(lock, LOCK_EX) != 0) {
    const std::string why = std::strerror(errno);
    if (lock >= 0) ::close(lock);
    ::unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot lock ", lock_path, ": ", why));
  }
  absl::Status done = absl::OkStatus();
  const int64_t there = iteration_in(path, checkpoint.shard);
  if (there > checkpoint.iteration) {
    ::unlink(tmp.c_str());
    done = absl::FailedPreconditionError(
        absl::StrCat(path, " holds iteration ", there, " already, later than ",
                     checkpoint.iteration));
  } else if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    done = absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path, ": ", why));
  }
  ::close(lock);  // releases the lock
  return done;
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
  const int64_t bytes = weight_bytes(checkpoint);
  std::vector<ShardCheckpoint> doomed;  // freed outside the lock
  absl::MutexLock lock(&replicas_mu);
  const auto key = std::make_pair(job, checkpoint.shard);
  auto it = replicas->find(key);
  const int64_t replaced = it != replicas->end() ? weight_bytes(it->second) : 0;
  if (it != replicas->end() && it->second.iteration > checkpoint.iteration) {
    return absl::OkStatus();  // it holds a later one
  }
  const int64_t limit = max_replica_bytes();
  auto fits = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(replicas_mu) {
    return (it != replicas->end() || replicas->size() < static_cast<size_t>(kMaxReplicas)) &&
           replica_bytes - replaced + bytes <= limit;
  };
  if (!fits()) {
    // Room from other jobs' replicas, never from this job's.
    for (auto other = replicas->begin(); other != replicas->end();) {
      if (other->first.first == job) {
        ++other;
        continue;
      }
      replica_bytes -= weight_bytes(other->second);
      doomed.push_back(std::move(other->second));
      other = replicas->erase(other);
    }
    if (!fits()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this server holds ", replicas->size(), " replicas (", replica_bytes >> 20,
          " MiB) of job ", job, "; one more of ", bytes >> 20, " MiB would pass its bounds (",
          kMaxReplicas, " replicas, ", limit >> 20, " MiB)"));
    }
  }
  replica_bytes += bytes - replaced;
  if (it != replicas->end()) {
    doomed.push_back(std::move(it->second));
    it->second = std::move(checkpoint);
  } else {
    replicas->emplace(key, std::move(checkpoint));
  }
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
    if (it->first.first != job) {
      ++it;
      continue;
    }
    replica_bytes -= weight_bytes(it->second);
    it = replicas->erase(it);
  }
}

}  // namespace ddprpc::models
