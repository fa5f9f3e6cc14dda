#include "rpc/transport/internal/cross_memory.h"

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace ddprpc::rpc::transport::cross_memory {
namespace {

std::atomic<int64_t> g_split_copies{0};

absl::Status copy_whole(pid_t pid, char* out, uint64_t remote, uint64_t n) {
  while (n > 0) {
    iovec local{out, n};
    iovec from{reinterpret_cast<void*>(remote), n};
    ssize_t got = process_vm_readv(pid, &local, 1, &from, 1, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno == ESRCH) return absl::UnavailableError("the peer process is gone");
      return absl::DataLossError(absl::StrCat("cannot read the peer's tensor memory: ",
                                              std::strerror(errno)));
    }
    if (got == 0) return absl::DataLossError("the peer's tensor memory ended early");
    out += got;
    remote += got;
    n -= static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

// One thread, started on first use and kept for the life of the process
// (never destroyed, so no static destructor waits on it), that shares one
// large read at a time with the thread that claimed it: both take chunks of
// it in turn until none is left, so a helper that is slow to be scheduled
// leaves its chunks to the caller instead of holding it up.
class CopyHelper {
 public:
  static CopyHelper& get() {
    static CopyHelper* const helper = new CopyHelper();
    return *helper;
  }

  // Shares the read of `n` bytes at `remote` with the helper thread;
  // false, having copied nothing, when the helper is claimed by another
  // read or belongs to the process this one was forked from.
  bool try_share(pid_t pid, char* out, uint64_t remote, uint64_t n, absl::Status* status) {
    if (!started_ || getpid() != owner_) return false;
    {
      absl::MutexLock lock(&mu_);
      if (claimed_) return false;
      claimed_ = true;
      job_ = Job{pid, out, remote, n};
      next_ = 0;
      status_ = absl::OkStatus();
    }
    while (copy_chunk()) {
    }
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &CopyHelper::helper_idle));
    claimed_ = false;
    *status = std::move(status_);
    return true;
  }

 private:
  static constexpr uint64_t kChunk = uint64_t{256} << 10;

  struct Job {
    pid_t pid = 0;
    char* out = nullptr;
    uint64_t remote = 0, n = 0;
  };

  // A thread that cannot be started leaves every read to its caller.
  CopyHelper() : owner_(getpid()), started_(start()) {}

  bool start() {
    try {
      std::thread([this] { loop(); }).detach();
      return true;
    } catch (const std::system_error&) {
      return false;
    }
  }

  bool work_left() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return claimed_ && next_ < job_.n && status_.ok();
  }
  bool helper_idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !helper_copying_; }

  // Takes and copies the next chunk of the claimed read; false when none
  // is left (or one failed). `helper` marks the helper thread's chunks.
  bool copy_chunk(bool helper = false) {
    Job job;
    uint64_t at = 0, len = 0;
    {
      absl::MutexLock lock(&mu_);
      if (!work_left()) return false;
      job = job_;
      at = next_;
      len = std::min(kChunk, job.n - at);
      next_ += len;
      if (helper) helper_copying_ = true;
    }
    absl::Status s = copy_whole(job.pid, job.out + at, job.remote + at, len);
    absl::MutexLock lock(&mu_);
    if (helper) helper_copying_ = false;
    if (!s.ok() && status_.ok()) status_ = std::move(s);
    return true;
  }

  void loop() {
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &CopyHelper::work_left));
      }
      copy_chunk(/*helper=*/true);
    }
  }

  const pid_t owner_;
  absl::Mutex mu_;
  // State below is protected by mu_.
  bool claimed_ ABSL_GUARDED_BY(mu_) = false;  // a read is being shared
  Job job_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;  // offset of the next chunk to take
  bool helper_copying_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);  // the first chunk's failure
  // Last: its thread starts once everything above is constructed.
  const bool started_;
};

}  // namespace

absl::Status read_remote(pid_t pid, void* dst, uint64_t remote, uint64_t n) {
  char* out = static_cast<char*>(dst);
  absl::Status status;
  if (n >= kSplitCopyBytes && CopyHelper::get().try_share(pid, out, remote, n, &status)) {
    g_split_copies.fetch_add(1, std::memory_order_relaxed);
    return status;
  }
  return copy_whole(pid, out, remote, n);
}

int64_t split_copies() { return g_split_copies.load(std::memory_order_relaxed); }

}  // namespace ddprpc::rpc::transport::cross_memory
