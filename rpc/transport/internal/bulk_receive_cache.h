// Memory for the tensors a bulk pull fills, kept resident between uses.
//
// A fresh multi-megabyte allocation comes from the kernel as pages that
// fault in, one at a time, as the pulled bytes land in them: on a virtual
// machine that costs several times the copy itself. The cache hands out
// buffers that earlier tensors gave back, their pages still mapped, and
// maps new ones populated in one call.
//
// A tensor it allocates owns its buffer like any CPU tensor: the buffer
// comes back to the cache when the tensor's storage is freed, on whatever
// thread frees it, and the storage stays resizable (a resize moves it to
// the CPU allocator). The cache keeps at most `max_idle_bytes` of buffers
// nobody uses, each for at most `max_idle_time`; beyond that they go back
// to the kernel. Buffers in use are the users' tensors and are not
// bounded here.
//
// Thread-safe. Tensors may outlive the cache's owner: the cache lives
// until the last of them is freed, and after close() it keeps nothing.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ddprpc::rpc::transport::bulk {

struct ReceiveCacheOptions {
  int64_t max_idle_bytes = int64_t{128} << 20;
  absl::Duration max_idle_time = absl::Seconds(10);
};

class ReceiveCache : public std::enable_shared_from_this<ReceiveCache> {
 public:
  static std::shared_ptr<ReceiveCache> create(const ReceiveCacheOptions& options);
  ~ReceiveCache();

  // An uninitialized contiguous CPU tensor of `dtype` and `sizes` (checked
  // by the caller), its bytes in a buffer of this cache. Throws
  // std::bad_alloc when no memory can be mapped.
  at::Tensor allocate(c10::ScalarType dtype, c10::IntArrayRef sizes);

  // Returns the idle buffers to the kernel; buffers given back later are
  // returned to it too.
  void close();

  // Idle bytes and buffers, and the buffers handed out so far that were
  // reused (for tests).
  int64_t idle_bytes() const;
  int idle_buffers() const;
  int64_t reused() const;

 private:
  struct Buffer;
  struct Idle {
    void* data;
    absl::Time since;
  };

  explicit ReceiveCache(const ReceiveCacheOptions& options) : options_(options) {}
  // A buffer of at least `bytes`: an idle one that fits, or a new mapping.
  void* take(size_t bytes, size_t* capacity);
  void give_back(void* data, size_t capacity);
  static void free_buffer(void* ctx);  // the DataPtr's deleter

  const ReceiveCacheOptions options_;
  mutable absl::Mutex mu_;
  // State below is protected by mu_.
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::multimap<size_t, Idle> idle_ ABSL_GUARDED_BY(mu_);  // by capacity
  int64_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reused_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ddprpc::rpc::transport::bulk
