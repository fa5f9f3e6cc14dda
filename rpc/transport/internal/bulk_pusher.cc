#include "rpc/transport/internal/bulk_pusher.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "rpc/transport/internal/bulk_lender.h"
#include "rpc/transport/internal/bulk_wire.h"

namespace ddprpc::rpc::transport::bulk {
namespace {

constexpr uint64_t kMinRangeBytes = 256 << 10;
// After connections fail, pushes to that worker wait before they are
// tried again (its tensors are pulled meanwhile): 1 s, doubling with each
// failure in a row up to a minute.
absl::Duration retry_delay(int failures) {
  return std::min(absl::Seconds(1) * (int64_t{1} << std::min(failures, 6)), absl::Seconds(60));
}

}  // namespace

Pusher::Pusher(PusherOptions options) : options_(std::move(options)) {
  absl::MutexLock lock(&mu_);
  slots_.resize(static_cast<size_t>(std::clamp<int>(options_.streams, 1, kMaxPushRanges)));
}

Pusher::~Pusher() {
  abort();
  if (connector_.joinable()) connector_.join();
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    for (auto& s : slots_) {
      if (s.thread.joinable()) threads.push_back(std::move(s.thread));
    }
  }
  for (auto& t : threads) t.join();
  absl::MutexLock lock(&mu_);
  for (auto& s : slots_) {
    if (s.fd >= 0) ::close(s.fd);
    s.fd = -1;
  }
}

void Pusher::abort() {
  interrupt_.fire();
  absl::MutexLock lock(&mu_);
  stopped_ = true;
  ready_ = false;
  for (auto& s : slots_) {
    if (s.fd >= 0) ::shutdown(s.fd, SHUT_RDWR);
    s.wake->Signal();
  }
}

void Pusher::fail_locked() {
  ready_ = false;
  retry_after_ = absl::Now() + retry_delay(failures_++);
  for (auto& s : slots_) {
    if (s.fd >= 0) ::shutdown(s.fd, SHUT_RDWR);  // closed by the next connect
  }
}

int Pusher::open_one(std::string* error) {
  return connect_proven(options_.endpoint, kPushHelloMagic, "bulk-push", options_.self,
                        options_.receiver, options_.token, options_.connect_timeout,
                        options_.silence, error, &interrupt_);
}

void Pusher::connect_all() {
  size_t count;
  {
    // The old connections go once no push uses them.
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return std::none_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.busy; });
    };
    mu_.Await(absl::Condition(&idle));
    for (auto& s : slots_) {
      if (s.fd >= 0) ::close(s.fd);
      s.fd = -1;
    }
    count = slots_.size();
  }
  std::vector<int> fds;
  std::string error;
  for (size_t i = 0; i < count; ++i) {
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) break;  // abort() came while connecting
    }
    const int fd = open_one(&error);
    if (fd < 0) break;
    fds.push_back(fd);
  }
  absl::MutexLock lock(&mu_);
  connecting_ = false;
  if (stopped_ || fds.size() < count) {
    for (int fd : fds) ::close(fd);
    if (!stopped_ && failures_ == 0) {
      LOG(WARNING) << "worker " << options_.self << ": no push connection to worker "
                   << options_.receiver << " at " << options_.endpoint << " (" << error
                   << "); its tensors are pulled, and pushes tried again later";
    }
    retry_after_ = absl::Now() + retry_delay(failures_++);
    return;
  }
  for (size_t i = 0; i < count; ++i) slots_[i].fd = fds[i];  // closed by the next connect
  for (size_t i = 0; i < count; ++i) {
    if (slots_[i].thread.joinable()) continue;
    try {
      slots_[i].thread = std::thread([this, i] { run(i); });
    } catch (const std::system_error& e) {
      LOG(WARNING) << "worker " << options_.self << ": no thread to push to worker "
                   << options_.receiver << ": " << e.what();
      retry_after_ = absl::Now() + retry_delay(failures_++);
      return;  // not ready: tensors are pulled
    }
  }
  ready_ = true;
  failures_ = 0;
}

uint32_t Pusher::push(uint64_t id, const at::Tensor& tensor) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return 0;
  if (!ready_) {
    if (!connecting_ && absl::Now() >= retry_after_) {
      if (connector_.joinable()) connector_.join();  // it has finished
      try {
        connector_ = std::thread([this] { connect_all(); });
        connecting_ = true;
      } catch (const std::system_error&) {
        retry_after_ = absl::Now() + retry_delay(failures_++);
      }
    }
    return 0;
  }
  for (const Slot& s : slots_) {
    if (s.busy) return 0;
  }
  const uint64_t nbytes = static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
  const uint32_t ranges =
      static_cast<uint32_t>(std::clamp<uint64_t>(nbytes / kMinRangeBytes, 1, slots_.size()));
  for (uint32_t r = 0; r < ranges; ++r) {
    Slot& s = slots_[r];
    s.busy = true;
    s.started = false;
    s.tensor = tensor;
    // As a lend's bytes: those of the storage it has now, whatever the
    // program points its tensor at meanwhile.
    s.storage = tensor.storage();
    s.first = static_cast<uint64_t>(tensor.storage_offset()) * tensor.element_size();
    s.nbytes = nbytes;
    s.id = id;
    s.index = r;
    s.ranges = ranges;
  }
  return ranges;
}

void Pusher::start(bool cancel) {
  absl::MutexLock lock(&mu_);
  for (auto& s : slots_) {
    if (!s.busy || s.started) continue;
    if (cancel) {
      s.busy = false;
      s.tensor = at::Tensor();
      s.storage = c10::Storage();
    } else {
      s.started = true;
      s.wake->Signal();
    }
  }
}

void Pusher::run(size_t slot) {
  for (;;) {
    int fd;
    at::Tensor tensor;
    c10::Storage storage;
    uint64_t first, total;
    uint64_t id;
    uint32_t index, ranges;
    {
      absl::MutexLock lock(&mu_);
      while (!stopped_ && !(slots_[slot].busy && slots_[slot].started)) {
        slots_[slot].wake->Wait(&mu_);
      }
      if (stopped_) {
        slots_[slot].busy = false;
        slots_[slot].tensor = at::Tensor();
        slots_[slot].storage = c10::Storage();
        return;
      }
      Slot& s = slots_[slot];
      fd = s.fd;
      tensor = s.tensor;
      storage = s.storage;
      first = s.first;
      total = s.nbytes;
      id = s.id;
      index = s.index;
      ranges = s.ranges;
    }
    uint64_t begin, length;
    range_of(total, ranges, index, &begin, &length);
    char head[kPushHeadBytes];
    put_u64(head, id);
    put_u64(head + 8, total);
    put_u32(head + 16, index);
    put_u32(head + 20, ranges);
    const absl::Time deadline = transfer_deadline(absl::Now(), options_.silence, length);
    absl::Status ok = write_all_blocking(fd, head, sizeof(head), deadline);
    if (ok.ok()) {
      absl::StatusOr<const char*> data = lent_data(storage, first, total);
      ok = data.ok() ? write_all_blocking(fd, *data + begin, length, deadline) : data.status();
    }
    tensor = at::Tensor();
    storage = c10::Storage();
    absl::MutexLock lock(&mu_);
    Slot& s = slots_[slot];
    s.busy = false;
    s.tensor = at::Tensor();
    s.storage = c10::Storage();
    if (!ok.ok() && !stopped_) {
      LOG(WARNING) << "worker " << options_.self << ": pushing lent tensor " << id
                   << " to worker " << options_.receiver << " failed (" << ok.message()
                   << "); it will be pulled";
      if (ready_) fail_locked();
    }
  }
}

}  // namespace ddprpc::rpc::transport::bulk
