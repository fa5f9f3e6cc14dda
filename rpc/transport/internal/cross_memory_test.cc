#include "rpc/transport/internal/cross_memory.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace ddprpc::rpc::transport::cross_memory {
namespace {

// The byte a region holds at `offset`, seeded so that two processes'
// copies of it differ.
char pattern(uint64_t offset, int seed) {
  return static_cast<char>((offset * 131 + offset / 4096 + seed) & 0xff);
}

void fill(char* p, uint64_t n, int seed) {
  for (uint64_t i = 0; i < n; ++i) p[i] = pattern(i, seed);
}

// Number of bytes of `got` that differ from the pattern.
uint64_t mismatches(const char* got, uint64_t n, int seed) {
  uint64_t bad = 0;
  for (uint64_t i = 0; i < n; ++i) bad += got[i] != pattern(i, seed);
  return bad;
}

// A child process holding `n` bytes at the same address as the region the
// parent mapped, written with the child's seed; `unmap_tail` bytes at the
// end are unmapped in the child. Killed and reaped when destroyed.
class Child {
 public:
  Child(uint64_t n, int seed, uint64_t unmap_tail = 0) : n_(n) {
    region_ = static_cast<char*>(
        mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    EXPECT_NE(region_, MAP_FAILED);
    int ready[2];
    EXPECT_EQ(pipe(ready), 0);
    pid_ = fork();
    if (pid_ == 0) {
      fill(region_, n, seed);
      if (unmap_tail > 0) munmap(region_ + n - unmap_tail, unmap_tail);
      char c = 1;
      if (write(ready[1], &c, 1) != 1) _exit(1);
      pause();
      _exit(0);
    }
    char c = 0;
    EXPECT_EQ(read(ready[0], &c, 1), 1);
    close(ready[0]);
    close(ready[1]);
  }
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    munmap(region_, n_);
  }
  pid_t pid() const { return pid_; }
  uint64_t address() const { return reinterpret_cast<uint64_t>(region_); }

 private:
  const uint64_t n_;
  char* region_ = nullptr;
  pid_t pid_ = -1;
};

TEST(CrossMemoryTest, ALargeReadIsSplitAndCopiesEveryByteOfThePeer) {
  const uint64_t n = 3 * kSplitCopyBytes + 123;
  Child child(n, /*seed=*/7);
  std::vector<char> got(n);
  const int64_t before = split_copies();
  // From an address that is not page-aligned, to an odd length.
  ASSERT_TRUE(read_remote(child.pid(), got.data(), child.address() + 5, n - 5).ok());
  EXPECT_EQ(split_copies(), before + 1);
  std::vector<char> want(n);
  fill(want.data(), n, 7);
  EXPECT_EQ(std::memcmp(got.data(), want.data() + 5, n - 5), 0);
}

TEST(CrossMemoryTest, ASmallReadIsCopiedByTheCallerAlone) {
  const uint64_t n = kSplitCopyBytes - 1;
  Child child(n, /*seed=*/3);
  std::vector<char> got(n);
  const int64_t before = split_copies();
  ASSERT_TRUE(read_remote(child.pid(), got.data(), child.address(), n).ok());
  EXPECT_EQ(split_copies(), before);
  EXPECT_EQ(mismatches(got.data(), n, 3), 0u);
}

TEST(CrossMemoryTest, ConcurrentLargeReadsAreEachCopiedWhole) {
  const uint64_t n = 2 * kSplitCopyBytes;
  Child child(n, /*seed=*/11);
  std::vector<std::thread> threads;
  std::vector<std::vector<char>> got(4, std::vector<char>(n));
  std::vector<int> ok(4, 0);  // not vector<bool>: each thread writes its own element
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        ok[t] = read_remote(child.pid(), got[t].data(), child.address(), n).ok();
        if (!ok[t]) return;
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int t = 0; t < 4; ++t) {
    ASSERT_TRUE(ok[t]) << t;
    EXPECT_EQ(mismatches(got[t].data(), n, 11), 0u) << t;
  }
}

TEST(CrossMemoryTest, TheHelpersFailureIsTheReadsFailure) {
  // The second half, the helper's, lies in pages the child unmapped.
  const uint64_t n = 2 * kSplitCopyBytes;
  Child child(n, /*seed=*/5, /*unmap_tail=*/kSplitCopyBytes / 2);
  std::vector<char> got(n);
  absl::Status s = read_remote(child.pid(), got.data(), child.address(), n);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  // And the helper is free again: the next read is split and succeeds.
  const int64_t before = split_copies();
  EXPECT_TRUE(read_remote(child.pid(), got.data(), child.address(), n / 2 + kSplitCopyBytes / 4).ok());
  EXPECT_EQ(split_copies(), before + 1);
}

TEST(CrossMemoryTest, AProcessThatIsGoneIsUnavailable) {
  pid_t pid = fork();
  if (pid == 0) _exit(0);
  ASSERT_EQ(waitpid(pid, nullptr, 0), pid);
  char byte = 0;
  EXPECT_EQ(read_remote(pid, &byte, 4096, 1).code(), absl::StatusCode::kUnavailable);
}

TEST(CrossMemoryTest, AForkedChildCopiesWithoutItsParentsHelper) {
  // Start the helper here, then fork: the child has no helper thread (and
  // may have inherited its mutex held); it copies alone.
  const uint64_t n = 2 * kSplitCopyBytes;
  Child child(n, /*seed=*/9);
  std::vector<char> got(n);
  ASSERT_TRUE(read_remote(child.pid(), got.data(), child.address(), n).ok());
  std::vector<char> mine(n);
  fill(mine.data(), n, 13);
  pid_t pid = fork();
  if (pid == 0) {
    std::vector<char> copy(n);
    const bool ok = read_remote(getpid(), copy.data(), reinterpret_cast<uint64_t>(mine.data()), n).ok();
    _exit(ok && mismatches(copy.data(), n, 13) == 0 ? 0 : 1);
  }
  int status = -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      FAIL() << "the forked child's copy did not finish in 20 s";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace ddprpc::rpc::transport::cross_memory
