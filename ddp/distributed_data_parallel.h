// ddp::DistributedDataParallel, mirroring torch.nn.parallel.DistributedDataParallel:
//
//   auto pg = ddp::init_process_group("gloo");            // env:// rendezvous
//   ddp::DistributedDataParallel ddp(model, pg);          // broadcasts rank 0's state
//   loss_of(model->forward(x)).backward();                // .grad now averaged
//
// The reducer hooks every parameter's gradient, packs gradients into buckets
// (reverse parameter order, the first bucket first_bucket_mb, the others up
// to bucket_cap_mb; the same on every rank), launches a bucket's allreduce
// as soon as all its gradients are in, so communication overlaps the rest of
// backward, and writes the averages back before backward returns.
// Inside a dist_autograd context the averaging happens in the distributed
// backward pass instead, on the gradients kept in the context (one DDP
// instance per process takes part in distributed autograd).
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddp/process_group.h"

namespace ddprpc::ddp {

// Reduces one flat gradient bucket: when the returned Work is done, `bucket`
// holds the average over the group.
using CommHook = std::function<std::shared_ptr<Work>(ProcessGroup& group, at::Tensor& bucket)>;

// The default: allreduce(kAvg) in the bucket's dtype.
CommHook allreduce_hook();
// Sends the bucket as float16 (half the bytes), averages, casts back.
CommHook fp16_compress_hook();

struct DdpOptions {
  double bucket_cap_mb = 25;
  double first_bucket_mb = 1;
  // Parameters that get no gradient in a backward pass are reduced as zeros
  // instead of failing the pass.
  bool find_unused_parameters = false;
  bool broadcast_buffers = true;
  absl::Duration timeout = absl::Seconds(300);
};

class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                          std::shared_ptr<ProcessGroup> group, DdpOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  torch::nn::Module& module() { return *module_; }
  ProcessGroup& process_group() { return *group_; }

  // While a NoSync lives, backward only accumulates into .grad locally; the
  // next synchronized backward averages the accumulated gradients.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel* ddp);
    ~NoSync();
    NoSync(NoSync&& other) noexcept : ddp_(other.ddp_) { other.ddp_ = nullptr; }

   private:
    DistributedDataParallel* ddp_;
  };
  NoSync no_sync() { return NoSync(this); }

  void register_comm_hook(CommHook hook);

  // Parameter indices (into module().parameters()) of each bucket.
  std::vector<std::vector<size_t>> bucket_indices() const;
  // Observer of the reducer's events, for tests and tracing:
  // "grad <param index>", "launch <bucket>", "done".
  void set_event_observer(std::function<void(const std::string&)> observer);

  class Reducer;

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  std::unique_ptr<Reducer> reducer_;
};

}  // namespace ddprpc::ddp
