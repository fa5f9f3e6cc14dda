#include "rpc/transport/internal/bulk_receive_cache.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/accumulate.h>
#include <sys/mman.h>

#include <algorithm>
#include <new>
#include <utility>
#include <vector>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace ddprpc::rpc::transport::bulk {
namespace {

// Buffers are mapped in multiples of this; a request takes an idle buffer
// at most a quarter larger than it needs.
constexpr size_t kGranule = 64 << 10;

size_t round_up(size_t bytes) {
  return (std::max<size_t>(bytes, 1) + kGranule - 1) / kGranule * kGranule;
}

}  // namespace

// The context of a tensor's DataPtr: its buffer and the cache it goes
// back to.
struct ReceiveCache::Buffer {
  std::shared_ptr<ReceiveCache> cache;
  void* data;
  size_t capacity;
};

std::shared_ptr<ReceiveCache> ReceiveCache::create(const ReceiveCacheOptions& options) {
  return std::shared_ptr<ReceiveCache>(new ReceiveCache(options));
}

ReceiveCache::~ReceiveCache() {
  for (auto& [capacity, idle] : idle_) ::munmap(idle.data, capacity);
}

void ReceiveCache::close() {
  std::multimap<size_t, Idle> idle;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    idle.swap(idle_);
    idle_bytes_ = 0;
  }
  for (auto& [capacity, buffer] : idle) ::munmap(buffer.data, capacity);
}

void* ReceiveCache::take(size_t bytes, size_t* capacity) {
  const size_t want = round_up(bytes);
  std::vector<std::pair<void*, size_t>> expired;
  void* found = nullptr;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (auto it = idle_.begin(); it != idle_.end();) {
      if (now - it->second.since < options_.max_idle_time) {
        ++it;
        continue;
      }
      expired.emplace_back(it->second.data, it->first);
      idle_bytes_ -= static_cast<int64_t>(it->first);
      it = idle_.erase(it);
    }
    auto it = idle_.lower_bound(want);
    if (it != idle_.end() && it->first <= want + want / 4) {
      found = it->second.data;
      *capacity = it->first;
      idle_bytes_ -= static_cast<int64_t>(it->first);
      ++reused_;
      idle_.erase(it);
    }
  }
  for (auto& [data, size] : expired) ::munmap(data, size);
  if (found != nullptr) return found;
  void* data = ::mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) throw std::bad_alloc();
  // All its pages in one call rather than a fault per page as the bytes
  // arrive. (A kernel without it answers EINVAL: the pages then fault in.)
  ::madvise(data, want, MADV_POPULATE_WRITE);
  *capacity = want;
  return data;
}

void ReceiveCache::give_back(void* data, size_t capacity) {
  {
    absl::MutexLock lock(&mu_);
    if (!closed_ && idle_bytes_ + static_cast<int64_t>(capacity) <= options_.max_idle_bytes) {
      idle_.emplace(capacity, Idle{data, absl::Now()});
      idle_bytes_ += static_cast<int64_t>(capacity);
      return;
    }
  }
  ::munmap(data, capacity);
}

void ReceiveCache::free_buffer(void* ctx) {
  auto* buffer = static_cast<Buffer*>(ctx);
  std::shared_ptr<ReceiveCache> cache = std::move(buffer->cache);
  try {
    cache->give_back(buffer->data, buffer->capacity);
  } catch (...) {
    ::munmap(buffer->data, buffer->capacity);  // no memory to keep it: freed
  }
  delete buffer;
}

at::Tensor ReceiveCache::allocate(c10::ScalarType dtype, c10::IntArrayRef sizes) {
  const caffe2::TypeMeta type = caffe2::TypeMeta::fromScalarType(dtype);
  const size_t nbytes = static_cast<size_t>(c10::multiply_integers(sizes)) * type.itemsize();
  size_t capacity = 0;
  void* data = take(nbytes, &capacity);
  Buffer* buffer;
  try {
    buffer = new Buffer{shared_from_this(), data, capacity};
  } catch (...) {
    ::munmap(data, capacity);
    throw;
  }
  c10::DataPtr ptr(data, buffer, &ReceiveCache::free_buffer, c10::Device(c10::DeviceType::CPU));
  // Resizable: a resize copies into memory from the CPU allocator and frees
  // this buffer (back to the cache).
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<int64_t>(nbytes),
                       std::move(ptr), c10::GetCPUAllocator(), /*resizable=*/true);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), type);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

int64_t ReceiveCache::idle_bytes() const {
  absl::MutexLock lock(&mu_);
  return idle_bytes_;
}

int ReceiveCache::idle_buffers() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(idle_.size());
}

int64_t ReceiveCache::reused() const {
  absl::MutexLock lock(&mu_);
  return reused_;
}

}  // namespace ddprpc::rpc::transport::bulk
