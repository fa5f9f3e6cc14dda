#include "rpc/transport/internal/bulk_puller.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "rpc/transport/internal/bulk_wire.h"

namespace ddprpc::rpc::transport::bulk {
namespace {

constexpr uint64_t kMinRangeBytes = 256 << 10;

}  // namespace

Puller::~Puller() {
  absl::MutexLock lock(&mu_);
  close_locked();
}

void Puller::close_locked() {
  for (int fd : fds_) ::close(fd);
  fds_.clear();
}

absl::Status Puller::open_one(int* fd) {
  std::string error;
  *fd = connect_proven(options_.endpoint, kHelloMagic, "bulk", options_.self, options_.lender,
                       options_.token, options_.connect_timeout, options_.silence, &error,
                       &interrupt_);
  if (*fd >= 0) return absl::OkStatus();
  if (interrupt_.fired()) return absl::CancelledError("the transport is shutting down");
  return absl::UnavailableError(error);
}

absl::Status Puller::connect_locked(size_t count) {
  while (fds_.size() < count) {
    {
      absl::MutexLock abort_lock(&abort_mu_);
      if (aborted_) return absl::CancelledError("the transport is shutting down");
    }
    int fd;
    absl::Status ok = open_one(&fd);
    if (!ok.ok()) return ok;
    fds_.push_back(fd);
  }
  return absl::OkStatus();
}

absl::Status Puller::pull_range(int fd, uint64_t id, uint64_t offset, uint64_t length,
                                char* dst, absl::Time deadline) {
  char pull[kPullBytes];
  put_u64(pull, id);
  put_u64(pull + 8, offset);
  put_u64(pull + 16, length);
  absl::Status ok = write_all_blocking(fd, pull, sizeof(pull), deadline);
  char head[kReplyHeadBytes];
  if (ok.ok()) ok = read_exact_blocking(fd, head, sizeof(head), deadline);
  if (!ok.ok()) return ok;
  const uint32_t status = get_u32(head);
  if (status == kPullUnknownLend) return absl::NotFoundError("it holds no such lend");
  if (status != kPullOk) return absl::OutOfRangeError("it refused the range");
  if (get_u64(head + 8) != length) {
    return absl::DataLossError(absl::StrCat("it answered ", get_u64(head + 8),
                                            " bytes where ", length, " were asked"));
  }
  return read_exact_blocking(fd, dst + offset, length, deadline);
}

void Puller::release_locked(uint64_t id) {
  // A release that cannot go out fails nothing (the lend then expires),
  // but the connection is not used again.
  char release[kPullBytes];
  put_u64(release, id);
  put_u64(release + 8, kReleaseOffset);
  put_u64(release + 16, 0);
  if (!write_all_blocking(fds_[0], release, sizeof(release)).ok()) close_locked();
}

void Puller::release(uint64_t id) {
  absl::MutexLock lock(&mu_);
  {
    absl::MutexLock abort_lock(&abort_mu_);
    if (aborted_) return;
  }
  if (connect_locked(1).ok()) release_locked(id);
}

void Puller::abort() {
  interrupt_.fire();
  absl::MutexLock lock(&abort_mu_);
  aborted_ = true;
  for (int fd : active_) ::shutdown(fd, SHUT_RDWR);
}

absl::Status Puller::pull(uint64_t id, void* dst, uint64_t nbytes) {
  absl::MutexLock lock(&mu_);
  const absl::Time deadline =
      transfer_deadline(absl::Now(), options_.silence, nbytes, options_.min_bytes_per_second);
  const uint64_t most = std::max(1, options_.streams);
  const uint64_t ranges = std::clamp<uint64_t>(nbytes / kMinRangeBytes, 1, most);
  absl::Status ok;
  {
    absl::MutexLock abort_lock(&abort_mu_);
    if (aborted_) ok = absl::CancelledError("the transport is shutting down");
  }
  if (ok.ok()) ok = connect_locked(ranges);
  if (ok.ok()) {
    absl::MutexLock abort_lock(&abort_mu_);
    if (aborted_) {
      ok = absl::CancelledError("the transport is shutting down");
    } else {
      active_ = fds_;
    }
  }
  std::vector<absl::Status> results(ranges);
  if (ok.ok()) {
    std::vector<std::thread> helpers;
    helpers.reserve(ranges);
    char* out = static_cast<char*>(dst);
    for (uint64_t r = ranges; r-- > 0;) {
      uint64_t begin, length;
      range_of(nbytes, ranges, r, &begin, &length);
      const int fd = fds_[r];
      auto run = [this, fd, id, begin, length, out, deadline, &results, r] {
        try {  // nothing may leave a thread by an exception
          results[r] = pull_range(fd, id, begin, length, out, deadline);
        } catch (const std::exception& e) {
          results[r] = absl::InternalError(e.what());
        }
      };
      if (r == 0) {
        run();
        continue;
      }
      try {
        helpers.emplace_back(run);
      } catch (const std::exception&) {
        run();  // no thread: this range after the others
      }
    }
    for (auto& t : helpers) t.join();
    {
      absl::MutexLock abort_lock(&abort_mu_);
      active_.clear();  // before any of them is closed
    }
    for (const absl::Status& s : results) {
      if (!s.ok()) {
        ok = s;
        break;
      }
    }
    if (ok.ok()) release_locked(id);
  }
  if (!ok.ok()) {
    close_locked();
    return absl::Status(ok.code(), absl::StrCat("pulling lent tensor ", id, " (", nbytes,
                                                " bytes) from worker ", options_.lender, " at ",
                                                options_.endpoint, ": ", ok.message()));
  }
  return absl::OkStatus();
}

}  // namespace ddprpc::rpc::transport::bulk
