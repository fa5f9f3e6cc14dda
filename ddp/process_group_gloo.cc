#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/types.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <thread>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "ddp/internal/op_queue.h"
#include "ddp/internal/pair_auth.h"
#include "ddp/internal/same_host_allreduce.h"
#include "ddp/internal/same_host_common.h"
#include "ddp/internal/shm_allreduce.h"
#include "ddp/internal/tcp_ring.h"
#include "ddp/process_group.h"
#include "rpc/rendezvous/init_method.h"
#include "rpc/rendezvous/store.h"
#include "rpc/transport/spin_budget.h"

namespace ddprpc::ddp {
namespace {

// gloo's rendezvous over the project's store, under a key prefix.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(std::shared_ptr<rpc::Store> store, std::string prefix)
      : store_(std::move(store)), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(prefix_ + key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    std::string v = store_->get(prefix_ + key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override {
    wait(keys, std::chrono::milliseconds(absl::ToInt64Milliseconds(store_->timeout())));
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_->wait(full, absl::Milliseconds(timeout.count()));
  }

 private:
  std::shared_ptr<rpc::Store> store_;
  const std::string prefix_;
};

// Largest allreduce (bytes) that uses Gloo's BCUBE algorithm (power-of-two
// group sizes only); larger ones use the ring.
constexpr int64_t kBcubeMaxBytes = 1 << 20;

// The ring's largest message (Gloo keeps two in flight, in a buffer of
// their size). Gloo's default of 1 MiB announces and acknowledges a message
// per megabyte; between 4 network namespaces (//benchmarks:allreduce
// --hosts=4, alternating runs) 4 MiB segments took 8.2-9.3 ms at 4 MiB
// against 9.9-10.2 ms, 26-28 ms at 16 MiB against 30-32 ms and 103-116 ms
// at 64 MiB against 131-132 ms; 256 KiB ones were slower still, and 16 MiB
// ones no faster than 4 MiB.
constexpr size_t kRingSegmentBytes = 4 << 20;

// Most rings an allreduce is striped over (ProcessGroupOptions::tcp_ring_streams).
constexpr int64_t kMaxRingStreams = 8;

// Smallest allreduce (bytes) the group's own TCP ring takes; below, the
// synchronous halving-doubling (up to 1 MiB without a ring) or Gloo's
// algorithms.
constexpr int64_t kRingMinBytes = 256 << 10;

// bool tensors reduce as bytes of 0 or 1: a sum is their maximum (a
// logical or, as in PyTorch's Gloo group).
internal::Reduction reduction_of(ReduceOp op, at::ScalarType type) {
  return op == ReduceOp::kMin   ? internal::Reduction::kMin
         : op == ReduceOp::kMax ? internal::Reduction::kMax
         : type == at::kBool    ? internal::Reduction::kMax
                                : internal::Reduction::kSum;  // kAvg divides afterwards
}

template <typename T>
void reduce_fn(ReduceOp op, at::ScalarType type, gloo::AllreduceOptions& opts) {
  opts.setReduceFunction(internal::reduce_fn<T>(reduction_of(op, type)));
}

template <typename F>
void dispatch_dtype(const at::Tensor& t, F f) {
  internal::dispatch_dtype(t.scalar_type(), "ProcessGroupGloo", f);
}

void check_tensor(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || t.layout() != c10::kStrided) {
    throw std::invalid_argument("ProcessGroupGloo: tensors must be dense CPU tensors");
  }
}

class ProcessGroupGloo : public ProcessGroup {
 public:
  ProcessGroupGloo(std::shared_ptr<rpc::Store> store, const std::string& prefix, int rank,
                   int size, ProcessGroupOptions options)
      : rank_(rank), size_(size), options_(options) {
    gloo::transport::tcp::attr attr(options.listen_address.c_str());
    auto device = gloo::transport::tcp::CreateDevice(attr);
    context_ = connect(store, prefix, device);
    sync_context_ = connect(store, prefix + "sync/", device);
    // Gloo's listener gives a pair the first connection that names it; only
    // the job's workers can prove the job's secret over it.
    if (store->authenticated()) {
      const internal::Signer sign = [&store](absl::string_view m) { return store->sign(m); };
      try {
        internal::authenticate_pairs(*context_, sign, prefix);
        internal::authenticate_pairs(*sync_context_, sign, prefix + "sync/");
      } catch (const std::exception& e) {
        throw std::runtime_error(absl::StrCat("ProcessGroupGloo: ", e.what()));
      }
    }
    for (int r = 0; r < size_; ++r) {
      if (r != rank_) sync_context_->getPair(r)->setSync(/*sync=*/true, /*busyPoll=*/false);
    }
    // Every rank must route an allreduce the same way: the smallest limit wins.
    int64_t limit = local_sync_max_bytes();
    gloo::AllreduceOptions opts(context_);
    opts.setOutput(&limit, 1);
    reduce_fn<int64_t>(ReduceOp::kMin, at::kLong, opts);
    gloo::allreduce(opts);
    sync_max_bytes_ = limit;
    if (size_ > 1) {
      shm_ = internal::ShmAllreduce::connect(context_, options.timeout,
                                             options.same_host_allreduce, options.max_spin);
      same_host_ = internal::SameHostAllreduce::connect(context_, options.same_host_allreduce);
    }
    if (size_ > 1 && !shm_ && !same_host_) connect_ring(store, prefix);
    // With a ring (on every rank alike), it takes what it can: from
    // kRingMinBytes up it beat the synchronous halving-doubling (4 ranks on
    // 4 network namespaces, 2 CPUs, alternating runs: 256 KiB 495-530 us
    // against 609-747 us, 1 MiB 1.86 ms against 2.04-2.17 ms).
    if (!rings_.empty()) sync_max_bytes_ = std::min(sync_max_bytes_, kRingMinBytes - 1);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "gloo"; }

  std::shared_ptr<Work> allreduce(std::vector<at::Tensor> tensors, ReduceOp op) override {
    for (const auto& t : tensors) check_tensor(t);
    return enqueue("allreduce", [this, tensors, op]() mutable { run_allreduce(tensors, op); });
  }

  void allreduce_and_wait(std::vector<at::Tensor> tensors, ReduceOp op,
                          absl::Duration timeout) override {
    for (const auto& t : tensors) check_tensor(t);
    // By value: queued behind others, it may outlive a wait that timed out.
    ops_.run_now(
        what("allreduce"),
        [this, tensors = std::move(tensors), op]() mutable { run_allreduce(tensors, op); },
        timeout);
  }

  std::shared_ptr<Work> broadcast(std::vector<at::Tensor> tensors, int root) override {
    for (const auto& t : tensors) check_tensor(t);
    return enqueue("broadcast", [this, tensors, root]() mutable {
      for (auto& t : tensors) {
        at::Tensor c = t.contiguous();
        dispatch_dtype(c, [&](auto zero) {
          using T = decltype(zero);
          gloo::BroadcastOptions opts(context_);
          opts.setRoot(root);
          opts.setOutput(static_cast<T*>(c.data_ptr()), c.numel());
          gloo::broadcast(opts);
        });
        if (!c.is_same(t)) t.copy_(c);
      }
    });
  }

  std::shared_ptr<Work> allgather(std::vector<at::Tensor> outputs, at::Tensor input) override {
    check_tensor(input);
    if (static_cast<int>(outputs.size()) != size_) {
      throw std::invalid_argument("ProcessGroupGloo::allgather needs one output per rank");
    }
    return enqueue("allgather", [this, outputs, input]() mutable {
      at::Tensor in = input.contiguous();
      at::Tensor out = at::empty({size_ * in.numel()}, in.options());
      dispatch_dtype(in, [&](auto zero) {
        using T = decltype(zero);
        gloo::AllgatherOptions opts(context_);
        opts.setInput(static_cast<T*>(in.data_ptr()), in.numel());
        opts.setOutput(static_cast<T*>(out.data_ptr()), out.numel());
        gloo::allgather(opts);
      });
      for (int r = 0; r < size_; ++r) {
        outputs[r].copy_(out.narrow(0, r * in.numel(), in.numel()).view(outputs[r].sizes()));
      }
    });
  }

  // Only the shared-memory path copies the tensors in and out directly;
  // the others concatenate them and copy the result back.
  bool reduces_lists_in_place(int64_t bytes) const override {
    return shm_ != nullptr && bytes <= internal::ShmAllreduce::kMaxBytes;
  }

  std::shared_ptr<Work> barrier() override {
    return enqueue("barrier", [this] {
      gloo::BarrierOptions opts(context_);
      gloo::barrier(opts);
    });
  }

 private:
  // An allreduce, on the thread that runs the group's operations.
  void run_allreduce(std::vector<at::Tensor>& tensors, ReduceOp op) {
    if (tensors.empty()) return;
    const internal::Reduction reduction = reduction_of(op, tensors[0].scalar_type());
    if (use_shm(tensors)) {
      std::vector<at::Tensor> dense;
      for (auto& t : tensors) dense.push_back(t.contiguous());
      // An average is divided inside the reduction, while the part is in cache.
      const bool divided =
          op == ReduceOp::kAvg && internal::ShmAllreduce::can_average(dense[0].scalar_type());
      shm_->run(dense, reduction, divided);
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (op == ReduceOp::kAvg && !divided) dense[i].div_(size_);
        if (!dense[i].is_same(tensors[i])) tensors[i].copy_(dense[i]);
      }
      return;
    }
    std::vector<at::Tensor> flat;
    for (auto& t : tensors) flat.push_back(t.reshape(-1));
    at::Tensor buffer;
    if (use_same_host(tensors)) {
      buffer = flat.size() == 1 && tensors[0].is_contiguous() ? flat[0] : at::cat(flat);
      same_host_->run(buffer, reduction);
    } else if (SyncAllreduce* sync = sync_allreduce(tensors, op)) {
      buffer = sync->staging;
      at::cat_out(buffer, flat);
      sync->algorithm->run();
    } else {
      buffer = flat.size() == 1 && tensors[0].is_contiguous() ? flat[0] : at::cat(flat);
      if (!rings_.empty() && buffer.numel() * buffer.element_size() >= kRingMinBytes) {
        ring_allreduce(buffer, op);
      } else {
        async_allreduce(buffer, op);
      }
    }
    if (op == ReduceOp::kAvg) buffer.div_(size_);
    if (buffer.data_ptr() != tensors[0].data_ptr() || flat.size() > 1) {
      int64_t offset = 0;
      for (auto& t : tensors) {
        t.copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
  }

  // How errors name operation `name`.
  std::string what(const char* name) const {
    return absl::StrCat("ProcessGroupGloo ", name, " (rank ", rank_, " of ", size_, ")");
  }
  std::shared_ptr<Work> enqueue(const char* name, std::function<void()> op) {
    return ops_.enqueue(what(name), std::move(op));
  }

  std::shared_ptr<gloo::rendezvous::Context> connect(std::shared_ptr<rpc::Store> store,
                                                     const std::string& prefix,
                                                     std::shared_ptr<gloo::transport::Device> device) {
    auto gloo_store = std::make_shared<GlooStore>(std::move(store), prefix);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
    context->setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(options_.timeout)));
    try {
      context->connectFullMesh(gloo_store, device);
    } catch (const std::exception& e) {
      throw std::runtime_error(absl::StrCat("ProcessGroupGloo: rank ", rank_, " of ", size_,
                                            " could not connect to its peers: ", e.what()));
    }
    return context;
  }

  // The streaming ring between hosts (internal/tcp_ring.h), built when
  // every rank takes part: as many rings as the ranks agree on (the
  // fewest any asks for), each over connections of its own.
  void connect_ring(const std::shared_ptr<rpc::Store>& store, const std::string& prefix) {
    int64_t streams = std::clamp<int64_t>(
        options_.tcp_ring_streams > 0 ? options_.tcp_ring_streams : default_ring_streams(), 1,
        kMaxRingStreams);
    gloo::AllreduceOptions agree(context_);
    agree.setOutput(&streams, 1);
    reduce_fn<int64_t>(ReduceOp::kMin, at::kLong, agree);
    gloo::allreduce(agree);
    internal::TcpRing::Options ring;
    ring.listen_address = options_.listen_address;
    ring.timeout = options_.timeout;
    ring.enabled = options_.tcp_ring;
    if (store->authenticated()) {
      ring.sign = [store](absl::string_view m) { return store->sign(m); };
    }
    for (int64_t s = 0; s < streams; ++s) {
      ring.scope = s == 0 ? prefix : absl::StrCat(prefix, "stream", s, "/");
      std::string why;
      std::unique_ptr<internal::TcpRing> one;
      try {
        one = internal::TcpRing::connect(
            rank_, size_,
            [this](std::vector<int64_t> mine) {
              return internal::allgather(context_, std::move(mine));
            },
            ring, &why);
      } catch (const std::exception& e) {
        throw std::runtime_error(absl::StrCat("ProcessGroupGloo: ", e.what()));
      }
      if (one == nullptr) {  // on every rank alike
        rings_.clear();
        return;
      }
      rings_.push_back(std::move(one));
    }
  }

  // Rings where this process may use 8 CPUs or more: 3; else 1. Each ring
  // streams its share of an allreduce on threads of its own, so that the
  // kernel's TCP work spreads over the CPUs; where they are few, the rings
  // would only take turns on them.
  static int64_t default_ring_streams() {
    return rpc::transport::usable_cpus() >= 8 ? 3 : 1;
  }

  // `buffer` cut into as many contiguous parts as there are rings, each
  // reduced around its ring at once (the first on this thread).
  void ring_allreduce(at::Tensor& buffer, ReduceOp op) {
    // One ring failing breaks them all: a later allreduce striped over the
    // others would otherwise wait for a lost rank until its timeout.
    for (const auto& ring : rings_) {
      if (!ring->failure().empty()) {
        throw std::runtime_error(absl::StrCat(
            "the group's TCP ring failed in an earlier allreduce: ", ring->failure()));
      }
    }
    const at::ScalarType type = buffer.scalar_type();
    const internal::Reduction reduction = reduction_of(op, type);
    const internal::ReduceFn reduce = internal::reduce_fn(type, reduction);
    const absl::Time deadline = absl::Now() + options_.timeout;
    const int64_t numel = buffer.numel();
    const size_t element = buffer.element_size();
    // Parts of at least kRingMinBytes: small allreduces stay on one ring.
    const int64_t parts = std::clamp<int64_t>(
        numel * static_cast<int64_t>(element) / kRingMinBytes, 1,
        static_cast<int64_t>(rings_.size()));
    char* base = static_cast<char*>(buffer.data_ptr());
    auto run = [&](int64_t p) {
      const int64_t begin = p * (numel / parts) + std::min(p, numel % parts);
      const int64_t end = (p + 1) * (numel / parts) + std::min(p + 1, numel % parts);
      // Every rank must cut the same whole into the same parts, for the
      // same op: each ring's header says which part of what it carries.
      const internal::RingCall call{numel, static_cast<uint32_t>(p),
                                         static_cast<uint32_t>(parts), static_cast<uint32_t>(op)};
      rings_[p]->allreduce(base + begin * static_cast<int64_t>(element), end - begin, element,
                           static_cast<int>(type), reduction, reduce, deadline, call);
    };
    if (parts == 1) return run(0);
    std::vector<std::string> errors(parts);
    auto run_part = [&](int64_t p) {
      try {
        run(p);
      } catch (const std::exception& e) {
        errors[p] = e.what();
      }
    };
    std::vector<std::thread> threads;
    std::vector<int64_t> here{0};  // parts this thread runs: the first, and any without a thread
    for (int64_t p = 1; p < parts; ++p) {
      try {
        threads.emplace_back(run_part, p);
      } catch (const std::system_error&) {
        here.push_back(p);  // the other ranks run it too: it must not be skipped
      }
    }
    for (int64_t p : here) run_part(p);
    for (auto& t : threads) t.join();
    for (const std::string& e : errors) {
      if (!e.empty()) throw std::runtime_error(e);
    }
  }

  // Gloo's collective API (unbound buffers): every message is announced and
  // acknowledged before its bytes go, on the device's event-loop thread.
  void async_allreduce(at::Tensor& buffer, ReduceOp op) {
    dispatch_dtype(buffer, [&](auto zero) {
      using T = decltype(zero);
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(static_cast<T*>(buffer.data_ptr()), buffer.numel());
      reduce_fn<T>(op, buffer.scalar_type(), opts);
      // BCUBE takes log2(n) steps instead of the ring's 2(n-1) and wins on
      // small, latency-bound buffers; on large ones Gloo's segmented ring
      // (torch.distributed's choice) is up to 4x faster (//benchmarks:allreduce,
      // 2 processes, 64 MiB: BCUBE 273 ms, ring 68 ms).
      const bool small = buffer.numel() * buffer.element_size() <= kBcubeMaxBytes;
      opts.setAlgorithm((size_ & (size_ - 1)) == 0 && small
                            ? gloo::AllreduceOptions::Algorithm::BCUBE
                            : gloo::AllreduceOptions::Algorithm::RING);
      opts.setMaxSegmentSize(kRingSegmentBytes);
      gloo::allreduce(opts);
    });
  }

  // The bytes of `tensors` when they share one dtype Gloo takes (throws
  // for another), -1 when they mix dtypes. The same on every rank.
  static int64_t bytes_of_one_dtype(const std::vector<at::Tensor>& tensors) {
    int64_t bytes = 0;
    for (const auto& t : tensors) {
      if (t.scalar_type() != tensors[0].scalar_type()) return -1;
      bytes += t.numel() * t.element_size();
    }
    dispatch_dtype(tensors[0], [](auto) {});
    return bytes;
  }

  // Allreduces when every rank is on this host: through shared memory up
  // to ShmAllreduce::kMaxBytes, by cross-process reads from
  // SameHostAllreduce::kMinBytes.
  bool use_shm(const std::vector<at::Tensor>& tensors) const {
    if (!shm_) return false;
    const int64_t bytes = bytes_of_one_dtype(tensors);
    return bytes >= 0 && bytes <= internal::ShmAllreduce::kMaxBytes;
  }
  bool use_same_host(const std::vector<at::Tensor>& tensors) const {
    return same_host_ && bytes_of_one_dtype(tensors) >= internal::SameHostAllreduce::kMinBytes;
  }

  // Small allreduces run Gloo's halving-doubling algorithm on a second mesh
  // whose pairs are in synchronous mode: the thread running the collective
  // reads and writes the sockets itself, with no event-loop thread and no
  // per-message handshake in between (8 processes, 700 KB on 2 cores: 1.8 ms
  // instead of 7.7 ms, 5 context switches per rank instead of 23). Such an
  // algorithm binds its buffer when built, so each (dtype, count, op) gets
  // one with a staging tensor, built on first use; every rank issues the
  // same allreduces in the same order, so they build them alike. Blocking
  // writes must fit the socket's send buffer (at most twice
  // net.core.wmem_max), or two peers writing to each other would both block:
  // larger buffers, other dtype mixes and the allreduces after the first
  // kMaxSyncAllreduces shapes take the asynchronous path. nullptr: not
  // eligible.
  struct SyncAllreduce {
    at::Tensor staging;
    std::unique_ptr<gloo::Algorithm> algorithm;
  };
  static constexpr size_t kMaxSyncAllreduces = 16;

  SyncAllreduce* sync_allreduce(const std::vector<at::Tensor>& tensors, ReduceOp op) {
    const at::ScalarType dtype = tensors[0].scalar_type();
    int64_t numel = 0;
    for (const auto& t : tensors) {
      if (t.scalar_type() != dtype) return nullptr;
      numel += t.numel();
    }
    if (numel == 0 || numel * tensors[0].element_size() > sync_max_bytes_) return nullptr;
    const auto key = std::make_tuple(static_cast<int>(dtype), numel, static_cast<int>(op));
    auto it = sync_allreduces_.find(key);
    if (it != sync_allreduces_.end()) return &it->second;
    if (sync_allreduces_.size() >= kMaxSyncAllreduces) return nullptr;
    SyncAllreduce entry;
    entry.staging = at::empty({numel}, tensors[0].options());
    dispatch_dtype(entry.staging, [&](auto zero) {
      using T = decltype(zero);
      const gloo::ReductionFunction<T>* fn = internal::reduction_function<T>(reduction_of(op, dtype));
      entry.algorithm = std::make_unique<gloo::AllreduceHalvingDoubling<T>>(
          sync_context_, std::vector<T*>{static_cast<T*>(entry.staging.data_ptr())},
          static_cast<int>(numel), fn);
    });
    return &sync_allreduces_.emplace(key, std::move(entry)).first->second;
  }

  // This host's net.core.wmem_max (Linux's default when unreadable), at
  // most kSyncMaxBytes (less with a ring). Beyond a megabyte the
  // synchronous algorithm's steps, each written whole and then read whole
  // by one thread, lose to the asynchronous ring, which moves segments both
  // ways at once (4 ranks on 4 network namespaces, 4 MiB: 18.5-21.9 ms
  // synchronous, 11.5-15.7 ms ring, in alternating runs).
  static constexpr int64_t kSyncMaxBytes = 1 << 20;
  static int64_t local_sync_max_bytes() {
    int64_t wmem_max = 212992;
    std::ifstream("/proc/sys/net/core/wmem_max") >> wmem_max;
    return std::min<int64_t>(wmem_max, kSyncMaxBytes);
  }

  const int rank_, size_;
  const ProcessGroupOptions options_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::shared_ptr<gloo::rendezvous::Context> sync_context_;  // pairs in synchronous mode
  // When every rank is on this host (null otherwise): small allreduces
  // through shared memory, large ones by cross-process reads.
  std::unique_ptr<internal::ShmAllreduce> shm_;
  std::unique_ptr<internal::SameHostAllreduce> same_host_;
  // Between hosts, when every rank takes part (null otherwise).
  std::vector<std::unique_ptr<internal::TcpRing>> rings_;
  int64_t sync_max_bytes_ = 0;  // set at construction, the same on every rank
  // Used only by the operation running (on ops_' thread, or in run_now).
  std::map<std::tuple<int, int64_t, int>, SyncAllreduce> sync_allreduces_;
  internal::OpQueue ops_;  // last: its thread stops before the contexts go
};

}  // namespace

std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<rpc::Store> store,
                                              const std::string& prefix, int rank, int size,
                                              ProcessGroupOptions options) {
  return std::make_shared<ProcessGroupGloo>(std::move(store), prefix, rank, size, options);
}

namespace {

// Keeps rank 0's store server alive as long as its group.
class OwningGroup : public ProcessGroup {
 public:
  OwningGroup(std::unique_ptr<rpc::StoreServer> server, std::shared_ptr<ProcessGroup> group)
      : group_(std::move(group)), server_(std::move(server)) {}
  ~OwningGroup() override {
    group_.reset();  // before the store goes
  }
  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  std::string backend() const override { return group_->backend(); }
  std::shared_ptr<Work> allreduce(std::vector<at::Tensor> t, ReduceOp op) override {
    return group_->allreduce(std::move(t), op);
  }
  std::shared_ptr<Work> broadcast(std::vector<at::Tensor> t, int root) override {
    return group_->broadcast(std::move(t), root);
  }
  std::shared_ptr<Work> allgather(std::vector<at::Tensor> o, at::Tensor i) override {
    return group_->allgather(std::move(o), std::move(i));
  }
  std::shared_ptr<Work> barrier() override { return group_->barrier(); }
  void allreduce_and_wait(std::vector<at::Tensor> t, ReduceOp op,
                          absl::Duration timeout) override {
    group_->allreduce_and_wait(std::move(t), op, timeout);
  }
  bool reduces_lists_in_place(int64_t bytes) const override {
    return group_->reduces_lists_in_place(bytes);
  }

 private:
  std::shared_ptr<ProcessGroup> group_;
  std::unique_ptr<rpc::StoreServer> server_;
};

}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(const std::string& backend,
                                                 const std::string& init_method, int rank,
                                                 int size, ProcessGroupOptions options) {
  if (backend != "gloo" && backend != "nccl") {
    throw std::invalid_argument("init_process_group: unknown backend '" + backend +
                                "' (use gloo or nccl)");
  }
  std::string host;
  int port = 0;
  try {
    const rpc::RankAndSize place = rpc::rank_and_size(rank, size);
    rank = place.rank;
    size = place.world_size;
    const rpc::StoreAddress address = rpc::parse_init_method(init_method);
    host = address.host;
    port = address.port;
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("init_process_group: ") + e.what());
  }
  const rpc::Security security = options.security.with_environment_defaults();
  if (!security.authenticated() && !security.encrypted() && !options.allow_insecure &&
      !(rpc::loopback_address(host) && rpc::loopback_address(options.listen_address))) {
    throw std::invalid_argument(absl::StrCat(
        "init_process_group: rank ", rank, " would ", rank == 0 ? "serve" : "reach",
        " the group's store at ", host, ":", port, " and listen on ", options.listen_address,
        " with no authentication: set ", rpc::kAuthTokenEnv, " (or ", rpc::kAuthTokenFileEnv,
        ", or ProcessGroupOptions::security) to the job's secret, and/or TLS; or set "
        "ProcessGroupOptions::allow_insecure to let anyone who can reach these ports join"));
  }
  std::unique_ptr<rpc::StoreServer> server;
  if (rank == 0) server = rpc::StoreServer::start(host, port, security);
  auto store = std::make_shared<rpc::Store>(host, port, options.timeout, security);
  auto group = backend == "nccl" ? make_nccl_group(store, "pg/", rank, size, options)
                                 : make_gloo_group(store, "pg/", rank, size, options);
  return std::make_shared<OwningGroup>(std::move(server), std::move(group));
}

}  // namespace ddprpc::ddp
