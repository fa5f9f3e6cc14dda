#include "ddp/internal/shm_allreduce.h"

#include <fcntl.h>
#include <gloo/context.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <random>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "rpc/transport/spin_budget.h"

namespace ddprpc::ddp::internal {

namespace {

// At the segment's start (rank 0 writes the nonce; the rest starts zeroed);
// the slots follow at kHeaderBytes.
struct Header {
  uint64_t nonce[2];
  alignas(64) std::atomic<uint32_t> arrived;     // ranks in the current barrier
  alignas(64) std::atomic<uint32_t> generation;  // barriers completed (the futex word)
  // 1 + the first rank whose group went away (0: none), so that the others
  // fail at once instead of waiting for it, as with a closed connection.
  alignas(64) std::atomic<uint32_t> left;
  // Barriers each rank has entered (for naming the ranks a wait is missing).
  alignas(64) std::atomic<uint64_t> entered[ShmAllreduce::kMaxRanks];
  // What each rank calls, written before the call's first barrier and
  // compared after it: ranks that disagree fail instead of mixing data.
  struct Call {
    uint64_t seq;
    int64_t numel;
    int32_t dtype;
    int32_t op;  // Reduction, + 16 when averaged
  };
  alignas(64) Call calls[ShmAllreduce::kMaxRanks];
};

static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "the barrier's words are shared between processes");

constexpr size_t kHeaderBytes = (sizeof(Header) + 4095) / 4096 * 4096;
constexpr size_t kSlotBytes = ShmAllreduce::kMaxBytes;
// Elements reduced per step: the accumulator and one peer block in cache.
constexpr int64_t kBlockBytes = 16 << 10;
// A sleeping rank looks at its peers and the deadline this often.
constexpr int64_t kSleepSliceNs = 20'000'000;

std::atomic<int64_t> g_runs{0};

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

int pidfd_open(int64_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

size_t segment_bytes(int size) { return kHeaderBytes + 2 * static_cast<size_t>(size) * kSlotBytes; }

std::string segment_name(int64_t a, int64_t b) {
  return absl::StrFormat("/ddprpc-allreduce-%016x%016x", static_cast<uint64_t>(a),
                         static_cast<uint64_t>(b));
}

// Maps the named segment of `bytes` (created, reserved and stamped with
// `nonce` when `create`); nullptr when it cannot.
void* map_segment(const std::string& name, size_t bytes, bool create, const uint64_t nonce[2]) {
  const int fd = create ? ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600)
                        : ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return nullptr;
  bool ok = true;
  if (create) {
    ok = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0;
  } else {
    struct stat st {};
    ok = ::fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes;
  }
  void* base = ok ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  ::close(fd);
  if (base == MAP_FAILED) {
    if (create) ::shm_unlink(name.c_str());
    return nullptr;
  }
  auto* words = static_cast<uint64_t*>(base);
  if (create) {
    words[0] = nonce[0];
    words[1] = nonce[1];
  } else if (words[0] != nonce[0] || words[1] != nonce[1]) {
    ::munmap(base, bytes);
    return nullptr;
  }
  return base;
}

// x[i] / d for n elements, in place: true division, as at::div_ does.
template <typename T>
void divide(T* x, int64_t n, T d) {
  for (int64_t i = 0; i < n; ++i) x[i] /= d;
}

}  // namespace

std::unique_ptr<ShmAllreduce> ShmAllreduce::connect(const std::shared_ptr<gloo::Context>& context,
                                                    absl::Duration timeout, bool willing,
                                                    absl::Duration max_spin) {
  const int n = context->size, me = context->rank;
  const size_t bytes = segment_bytes(n);
  // Rank 0 names and stamps the segment; {created, name (2 words), nonce
  // (2 words)} from every rank, rank 0's used.
  std::random_device random;
  auto word = [&random] { return (static_cast<uint64_t>(random()) << 32) ^ random(); };
  const uint64_t nonce[2] = {word(), word() ^ static_cast<uint64_t>(::getpid())};
  const int64_t a = static_cast<int64_t>(word()), b = static_cast<int64_t>(word());
  void* base = nullptr;
  const std::string created = segment_name(a, b);
  if (me == 0 && n <= kMaxRanks && willing) {
    base = map_segment(created, bytes, /*create=*/true, nonce);
  }
  // Until the segment goes to the new object, a failure (a peer that dies
  // or stalls in an allgather) unlinks it, unmaps it and closes what was
  // opened: nothing stays in /dev/shm or in this process.
  bool linked = base != nullptr;  // rank 0's segment still has its name
  std::vector<int> pidfds(n, -1);
  auto undo = [&] {
    if (linked) ::shm_unlink(created.c_str());
    for (int& fd : pidfds) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
    if (base != nullptr) ::munmap(base, bytes);
    base = nullptr;
  };
  try {
    const std::vector<int64_t> offer =
        allgather(context, {base != nullptr ? 1 : 0, a, b, static_cast<int64_t>(nonce[0]),
                            static_cast<int64_t>(nonce[1])});
    const std::string name = segment_name(offer[1], offer[2]);
    if (offer[0] == 0) return nullptr;  // the same answer on every rank
    if (me != 0 && willing) {
      const uint64_t expected[2] = {static_cast<uint64_t>(offer[3]), static_cast<uint64_t>(offer[4])};
      base = map_segment(name, bytes, /*create=*/false, expected);
    }
    const std::vector<int64_t> mapped = allgather(context, {base != nullptr ? 1 : 0, ::getpid()});
    if (me == 0) ::shm_unlink(name.c_str());  // every rank has opened it or given up
    linked = false;
    // Every peer's pid must be one this process can watch (same host, same
    // pid namespace).
    std::vector<int64_t> pids(n);
    bool ok = base != nullptr;
    for (int r = 0; r < n; ++r) {
      pids[r] = mapped[2 * r + 1];
      if (r == me || !ok) continue;
      pidfds[r] = pidfd_open(pids[r]);
      ok = pidfds[r] >= 0;
    }
    const std::vector<int64_t> oks = allgather(context, {ok ? 1 : 0});
    bool all = true;
    for (int r = 0; r < n; ++r) all = all && mapped[2 * r] == 1 && oks[r] == 1;
    if (!all) {
      undo();
      return nullptr;
    }
    auto made = std::unique_ptr<ShmAllreduce>(
        new ShmAllreduce(me, n, base, bytes, std::move(pids), pidfds, timeout, max_spin));
    pidfds.assign(n, -1);  // the object owns them, and the mapping
    base = nullptr;
    return made;
  } catch (...) {
    undo();
    throw;
  }
}

ShmAllreduce::ShmAllreduce(int rank, int size, void* base, size_t bytes, std::vector<int64_t> pids,
                           std::vector<int> pidfds, absl::Duration timeout,
                           absl::Duration max_spin)
    : rank_(rank),
      size_(size),
      base_(base),
      bytes_(bytes),
      pids_(std::move(pids)),
      pidfds_(std::move(pidfds)),
      timeout_(timeout),
      spin_(size <= rpc::transport::usable_cpus()
                ? absl::Nanoseconds(rpc::transport::spin_ns(max_spin))
                : absl::ZeroDuration()),
      accumulator_(kBlockBytes) {}

ShmAllreduce::~ShmAllreduce() {
  // A group that failed does not say it left: its peers find the cause of
  // that failure (an exit, another rank leaving, the timeout) themselves.
  if (!broken_) {
    auto* h = static_cast<Header*>(base_);
    uint32_t none = 0;
    h->left.compare_exchange_strong(none, static_cast<uint32_t>(rank_) + 1,
                                    std::memory_order_acq_rel);
    futex(&h->generation, FUTEX_WAKE, INT_MAX, nullptr);
  }
  for (int fd : pidfds_) {
    if (fd >= 0) ::close(fd);
  }
  ::munmap(base_, bytes_);
}

int64_t ShmAllreduce::runs() { return g_runs.load(); }

char* ShmAllreduce::slot(int set, int rank) const {
  return static_cast<char*>(base_) + kHeaderBytes +
         (static_cast<size_t>(set) * size_ + rank) * kSlotBytes;
}

void ShmAllreduce::fail(const std::string& why) {
  broken_ = true;
  throw std::runtime_error("same-host allreduce (rank " + std::to_string(rank_) + " of " +
                           std::to_string(size_) + "): " + why);
}

void ShmAllreduce::barrier(absl::Time deadline) {
  Header* h = static_cast<Header*>(base_);
  ++barriers_;
  h->entered[rank_].store(barriers_, std::memory_order_relaxed);
  const uint32_t generation = h->generation.load(std::memory_order_acquire);
  if (h->arrived.fetch_add(1, std::memory_order_acq_rel) == static_cast<uint32_t>(size_ - 1)) {
    // Last in: the next barrier counts from zero, then everyone goes.
    h->arrived.store(0, std::memory_order_relaxed);
    h->generation.store(generation + 1, std::memory_order_release);
    futex(&h->generation, FUTEX_WAKE, INT_MAX, nullptr);
    return;
  }
  await(generation, deadline);
}

void ShmAllreduce::await(uint32_t generation, absl::Time deadline) {
  Header* h = static_cast<Header*>(base_);
  auto moved = [&] { return h->generation.load(std::memory_order_acquire) != generation; };
  const absl::Time start = absl::Now();
  if (spin_ > absl::ZeroDuration()) {
    const absl::Time until = start + spin_;
    for (int i = 1;; ++i) {
      if (moved()) return;
      cpu_relax();
      if (i % 64 == 0 && absl::Now() > until) break;
    }
  }
  // Ranks that have not entered this barrier yet (for a failure's message).
  auto missing = [&] {
    std::vector<std::string> out;
    for (int r = 0; r < size_; ++r) {
      if (h->entered[r].load(std::memory_order_relaxed) < barriers_) {
        out.push_back(absl::StrCat(r, " (pid ", pids_[r], ")"));
      }
    }
    return absl::StrJoin(out, ", rank ");
  };
  for (;;) {
    const timespec slice{0, kSleepSliceNs};
    futex(&h->generation, FUTEX_WAIT, generation, &slice);  // returns at once if it moved
    if (moved()) return;
    // Each failure below looks again first: the barrier may have completed
    // since (and a peer then exited or left, as at the end of a job).
    std::vector<pollfd> watch;
    for (int fd : pidfds_) {
      if (fd >= 0) watch.push_back({fd, POLLIN, 0});
    }
    if (::poll(watch.data(), watch.size(), 0) > 0) {
      std::vector<std::string> gone;
      for (int r = 0; r < size_; ++r) {
        if (pidfds_[r] < 0) continue;
        pollfd one{pidfds_[r], POLLIN, 0};
        if (::poll(&one, 1, 0) > 0) gone.push_back(absl::StrCat(r, " (pid ", pids_[r], ")"));
      }
      if (moved()) return;
      fail(absl::StrCat("rank ", absl::StrJoin(gone, ", rank "), " exited; waiting for rank ",
                        missing()));
    }
    if (const uint32_t gone = h->left.load(std::memory_order_acquire); gone != 0) {
      if (moved()) return;
      // Written by a peer: an index only once checked.
      const int64_t r = static_cast<int64_t>(gone) - 1;
      if (r < 0 || r >= size_ || r == rank_) {
        fail(absl::StrCat("the segment's header names rank ", r,
                          " as gone, not a peer of this group (corrupt segment)"));
      }
      fail(absl::StrCat("rank ", r, " (pid ", pids_[r], ") left the group (its process group ",
                        "was destroyed); waiting for rank ", missing()));
    }
    if (absl::Now() > deadline) {
      if (moved()) return;
      fail(absl::StrCat("rank ", missing(), " did not arrive within ",
                        absl::FormatDuration(timeout_)));
    }
  }
}

void ShmAllreduce::run(const std::vector<at::Tensor>& tensors, Reduction op, bool average) {
  if (broken_) fail("unusable after an earlier failure");
  if (tensors.empty()) return;
  const at::ScalarType type = tensors[0].scalar_type();
  const ReduceFn reduce = reduce_fn(type, op);
  if (average && (op != Reduction::kSum || !can_average(type))) {
    throw std::invalid_argument("same-host allreduce: averages are of float or double sums");
  }
  const int64_t item = static_cast<int64_t>(c10::elementSize(type));
  int64_t numel = 0;
  for (const auto& t : tensors) {
    if (t.scalar_type() != type || !t.is_contiguous() || !t.device().is_cpu()) {
      throw std::invalid_argument("same-host allreduce: tensors must be contiguous CPU tensors of one dtype");
    }
    numel += t.numel();
  }
  if (numel * item > kMaxBytes) {
    throw std::invalid_argument(absl::StrCat("same-host allreduce: ", numel * item,
                                             " bytes, more than its ", kMaxBytes));
  }
  const uint64_t seq = calls_++;
  const int set = static_cast<int>(seq & 1);
  char* const mine = slot(set, rank_);
  int64_t offset = 0;
  for (const auto& t : tensors) {
    std::memcpy(mine + offset, t.data_ptr(), t.numel() * item);
    offset += t.numel() * item;
  }
  auto* h = static_cast<Header*>(base_);
  const Header::Call call{seq, numel, static_cast<int32_t>(type),
                          static_cast<int32_t>(op) + (average ? 16 : 0)};
  h->calls[rank_] = call;
  // One deadline for the call's two barriers: a peer that arrives just in
  // time for each must not stretch the call to twice the timeout.
  const absl::Time deadline = absl::Now() + timeout_;
  barrier(deadline);
  // Written before the barrier by every rank, read after it (the barrier's
  // atomics order them); every rank compares the same records.
  for (int r = 0; r < size_; ++r) {
    const Header::Call theirs = h->calls[r];
    if (theirs.seq != call.seq || theirs.numel != call.numel || theirs.dtype != call.dtype ||
        theirs.op != call.op) {
      fail(absl::StrCat("rank ", r, " makes call ", theirs.seq, " of ", theirs.numel,
                        " elements (dtype ", theirs.dtype, ", reduction ", theirs.op, "), rank ",
                        rank_, " call ", call.seq, " of ", call.numel, " (dtype ", call.dtype,
                        ", reduction ", call.op, "): every rank must make the same call"));
    }
  }
  // This rank's part, folded over the ranks in order: slot 0 op slot 1 op ...
  auto begin = [&](int r) { return numel * r / size_; };
  const int64_t step = kBlockBytes / item;
  char* const acc = accumulator_.data();
  for (int64_t pos = begin(rank_), end = begin(rank_ + 1); pos < end; pos += step) {
    const int64_t len = std::min(step, end - pos);
    const int64_t at = pos * item;
    reduce(acc, slot(set, 0) + at, slot(set, 1) + at, len);
    for (int r = 2; r < size_; ++r) reduce(acc, acc, slot(set, r) + at, len);
    if (average) {
      if (type == at::kFloat) {
        divide(reinterpret_cast<float*>(acc), len, static_cast<float>(size_));
      } else {
        divide(reinterpret_cast<double*>(acc), len, static_cast<double>(size_));
      }
    }
    std::memcpy(mine + at, acc, len * item);
  }
  barrier(deadline);
  // Every rank's reduced part into the tensors.
  int r = 0;
  offset = 0;
  for (const auto& t : tensors) {
    char* const out = static_cast<char*>(t.data_ptr());
    for (int64_t pos = offset, end = offset + t.numel(); pos < end;) {
      while (begin(r + 1) <= pos) ++r;
      const int64_t len = std::min(end, begin(r + 1)) - pos;
      std::memcpy(out + (pos - offset) * item, slot(set, r) + pos * item, len * item);
      pos += len;
    }
    offset += t.numel();
  }
  g_runs.fetch_add(1);
}

}  // namespace ddprpc::ddp::internal
