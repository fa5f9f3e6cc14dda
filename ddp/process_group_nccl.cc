// NCCL backend of ProcessGroup, compiled when the CUDA toolkit was found at
// build time (DDPRPC_WITH_NCCL). CPU tensors (all a CPU-only libtorch has)
// are staged through a device buffer; CUDA tensors on the group's device
// (a CUDA libtorch, DDPRPC_LIBTORCH) are reduced in place, without copies
// through host memory.
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "ddp/internal/op_queue.h"
#include "ddp/process_group.h"
#include "rpc/rendezvous/store.h"

#ifdef DDPRPC_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace ddprpc::ddp {

int nccl_devices() {
#ifdef DDPRPC_WITH_NCCL
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
#else
  return 0;
#endif
}

bool nccl_available() { return nccl_devices() > 0; }

#ifdef DDPRPC_WITH_NCCL
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}
void check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

// A deadline `timeout` from now (none for an infinite timeout).
absl::Time deadline_after(absl::Duration timeout) {
  return timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
}

ncclDataType_t nccl_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    case at::kBool: return ncclUint8;  // 0 or 1 per byte; a sum is reduced as a max
    default:
      throw std::invalid_argument(std::string("ProcessGroupNccl: unsupported dtype ") +
                                  c10::toString(t.scalar_type()));
  }
}

class ProcessGroupNccl : public ProcessGroup {
 public:
  ProcessGroupNccl(const std::shared_ptr<rpc::Store>& store, const std::string& prefix, int rank,
                   int size, absl::Duration timeout)
      : rank_(rank), size_(size), timeout_(timeout) {
    int devices = 0;
    check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    device_ = rank % devices;
    check(cudaSetDevice(device_), "cudaSetDevice");
    ncclUniqueId id;
    if (rank == 0) {
      check(ncclGetUniqueId(&id), "ncclGetUniqueId");
      store->set(prefix + "nccl_id", std::string(id.internal, sizeof(id.internal)));
    } else {
      std::string v = store->get(prefix + "nccl_id");
      std::memcpy(id.internal, v.data(), std::min(v.size(), sizeof(id.internal)));
    }
    // A non-blocking communicator: its initialisation waits for every rank,
    // and one that never comes must fail the group at its timeout instead
    // of blocking this thread for good (NCCL's own wait has no timeout).
    // Calls on it may then return ncclInProgress; ready() waits those out.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t init = ncclCommInitRankConfig(&comm_, size, id, rank, &config);
    if (init != ncclInProgress) check(init, "ncclCommInitRankConfig");
    try {
      ready("ncclCommInitRankConfig", deadline_after(timeout_),
            absl::StrCat(" (rank ", rank, " of ", size, "; a rank that never came?)"));
    } catch (...) {
      if (comm_ != nullptr && !aborted_) ncclCommAbort(comm_);
      throw;
    }
    check(cudaStreamCreate(&stream_), "cudaStreamCreate");
  }

  ~ProcessGroupNccl() override {
    ops_.reset();  // finish queued operations first
    if (buffer_) cudaFree(buffer_);
    if (aborted_) {
      // ncclCommAbort freed the communicator.
    } else {
      // A non-blocking communicator finalizes asynchronously: wait for it
      // (bounded) before freeing it, or abort it.
      const ncclResult_t finalize = ncclCommFinalize(comm_);
      bool finalized = finalize == ncclSuccess;
      if (finalize == ncclInProgress) {
        try {
          ready("ncclCommFinalize", deadline_after(std::min(timeout_, absl::Seconds(30))), "");
          finalized = true;
        } catch (const std::exception&) {
        }
      }
      if (finalized) {
        ncclCommDestroy(comm_);
      } else if (!aborted_) {
        ncclCommAbort(comm_);
      }
    }
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }

  std::shared_ptr<Work> allreduce(std::vector<at::Tensor> tensors, ReduceOp op) override {
    return enqueue("allreduce", [this, tensors, op]() mutable {
      for (auto& t : tensors) {
        ncclRedOp_t nop = op == ReduceOp::kMin ? ncclMin : op == ReduceOp::kMax ? ncclMax : ncclSum;
        // bool: a sum is a logical or (as in the Gloo group), a max of 0/1 bytes.
        if (t.scalar_type() == at::kBool && nop == ncclSum) nop = ncclMax;
        staged(t, [&](void* dev) {
          enqueued(ncclAllReduce(dev, dev, t.numel(), nccl_type(t), nop, comm_, stream_), "ncclAllReduce");
        });
        if (op == ReduceOp::kAvg) t.div_(size_);
      }
    });
  }

  std::shared_ptr<Work> broadcast(std::vector<at::Tensor> tensors, int root) override {
    return enqueue("broadcast", [this, tensors, root]() mutable {
      for (auto& t : tensors) {
        staged(t, [&](void* dev) {
          enqueued(ncclBroadcast(dev, dev, t.numel(), nccl_type(t), root, comm_, stream_), "ncclBroadcast");
        });
      }
    });
  }

  std::shared_ptr<Work> allgather(std::vector<at::Tensor> outputs, at::Tensor input) override {
    if (static_cast<int>(outputs.size()) != size_) {
      throw std::invalid_argument("ProcessGroupNccl::allgather needs one output per rank");
    }
    return enqueue("allgather", [this, outputs, input]() mutable {
      at::Tensor gathered = at::empty({size_ * input.numel()}, input.options());
      gathered.narrow(0, rank_ * input.numel(), input.numel()).copy_(input.reshape(-1));
      staged(gathered, [&](void* dev) {
        char* base = static_cast<char*>(dev);
        const size_t bytes = input.numel() * input.element_size();
        enqueued(ncclAllGather(base + rank_ * bytes, base, input.numel(), nccl_type(input), comm_,
                               stream_),
                 "ncclAllGather");
      });
      for (int r = 0; r < size_; ++r) {
        outputs[r].copy_(gathered.narrow(0, r * input.numel(), input.numel()).view(outputs[r].sizes()));
      }
    });
  }

  std::shared_ptr<Work> barrier() override {
    at::Tensor one = at::empty({1}, at::kFloat).fill_(1);
    return allreduce({one}, ReduceOp::kSum);
  }

 private:
  std::shared_ptr<Work> enqueue(const char* name, std::function<void()> op) {
    return ops_->enqueue(absl::StrCat("ProcessGroupNccl ", name, " (rank ", rank_, " of ", size_, ")"),
                         std::move(op));
  }

  // Runs `op` on `t`'s data on the device: in place for a CUDA tensor on
  // the group's device; otherwise copies `t` there and back.
  template <typename F>
  void staged(at::Tensor& t, F op) {
    // ncclCommAbort freed the communicator: nothing may use it again.
    if (aborted_) throw_aborted();
    check(cudaSetDevice(device_), "cudaSetDevice");
    if (t.is_cuda()) {
      if (t.device().index() != device_) {
        throw std::invalid_argument(absl::StrCat("ProcessGroupNccl: a tensor on cuda:",
                                                 t.device().index(), ", the group uses cuda:",
                                                 device_));
      }
      at::Tensor dev = t.contiguous();
      // Whatever libtorch's streams still write into the tensor comes first.
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      op(dev.data_ptr());
      synchronize();
      if (!dev.is_same(t)) t.copy_(dev);
      return;
    }
    at::Tensor host = t.contiguous();
    const size_t bytes = host.numel() * host.element_size();
    if (bytes > capacity_) {
      if (buffer_) cudaFree(buffer_);
      buffer_ = nullptr;
      check(cudaMalloc(&buffer_, bytes), "cudaMalloc");
      capacity_ = bytes;
    }
    check(cudaMemcpyAsync(buffer_, host.data_ptr(), bytes, cudaMemcpyHostToDevice, stream_),
          "cudaMemcpy to device");
    op(buffer_);
    check(cudaMemcpyAsync(host.data_ptr(), buffer_, bytes, cudaMemcpyDeviceToHost, stream_),
          "cudaMemcpy to host");
    synchronize();
    if (!host.is_same(t)) t.copy_(host);
  }

  // An operation's enqueueing on the non-blocking communicator: done, or
  // still in progress (waited for, at most the group's timeout).
  void enqueued(ncclResult_t r, const char* what) {
    if (r == ncclInProgress) {
      ready(what, deadline_after(timeout_), "");
    } else {
      check(r, what);
    }
  }

  // Waits until the communicator has no call in progress, polling its
  // state, until `deadline`; past it, or on NCCL's error, aborts the
  // communicator and throws naming `what` (and `context`).
  void ready(const char* what, absl::Time deadline, const std::string& context) {
    absl::Duration pause = absl::Microseconds(10);
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) state = r;
      if (state == ncclSuccess) return;
      if (state != ncclInProgress || absl::Now() >= deadline) {
        ncclCommAbort(comm_);
        aborted_ = true;
        throw std::runtime_error(
            state != ncclInProgress
                ? absl::StrCat(what, ": ", ncclGetErrorString(state), context)
                : absl::StrCat(what, " did not complete within ", absl::FormatDuration(timeout_),
                               context, "; communicator aborted"));
      }
      absl::SleepFor(pause);
      pause = std::min(pause * 2, absl::Milliseconds(1));
    }
  }

  // Waits for the stream, at most the group's timeout: NCCL blocks forever
  // on a peer that died or stopped, so past the timeout (or on NCCL's own
  // asynchronous error) the communicator is aborted and the operation, and
  // every later one, fails.
  [[noreturn]] static void throw_aborted() {
    throw std::runtime_error("the NCCL communicator was aborted after an earlier failure");
  }

  void synchronize() {
    if (aborted_) throw_aborted();
    const absl::Time deadline = deadline_after(timeout_);
    absl::Duration pause = absl::Microseconds(10);
    while (true) {
      const cudaError_t state = cudaStreamQuery(stream_);
      if (state == cudaSuccess) return;
      if (state != cudaErrorNotReady) check(state, "cudaStreamQuery");
      ncclResult_t async_error = ncclSuccess;
      check(ncclCommGetAsyncError(comm_, &async_error), "ncclCommGetAsyncError");
      // ncclInProgress: the non-blocking communicator is still busy, no error.
      if (async_error == ncclInProgress) async_error = ncclSuccess;
      if (async_error != ncclSuccess || absl::Now() >= deadline) {
        ncclCommAbort(comm_);
        aborted_ = true;
        throw std::runtime_error(
            async_error != ncclSuccess
                ? absl::StrCat("NCCL failed: ", ncclGetErrorString(async_error))
                : absl::StrCat("did not complete within ", absl::FormatDuration(timeout_),
                               " (a rank stopped or is unreachable); communicator aborted"));
      }
      absl::SleepFor(pause);
      pause = std::min(pause * 2, absl::Milliseconds(1));
    }
  }

  const int rank_, size_;
  const absl::Duration timeout_;
  bool aborted_ = false;  // used only on the op thread (and the destructor after it)
  int device_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* buffer_ = nullptr;  // used only on the op thread
  size_t capacity_ = 0;
  std::unique_ptr<internal::OpQueue> ops_ = std::make_unique<internal::OpQueue>();
};

}  // namespace
#endif  // DDPRPC_WITH_NCCL

std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<rpc::Store> store,
                                              const std::string& prefix, int rank, int size,
                                              ProcessGroupOptions options) {
#ifdef DDPRPC_WITH_NCCL
  if (!nccl_available()) throw std::runtime_error("NCCL backend: no CUDA device is visible");
  return std::make_shared<ProcessGroupNccl>(store, prefix, rank, size, options.timeout);
#else
  (void)store, (void)prefix, (void)rank, (void)size, (void)options;
  throw std::runtime_error("NCCL backend: built without CUDA (no /usr/local/cuda at build time)");
#endif
}

}  // namespace ddprpc::ddp
