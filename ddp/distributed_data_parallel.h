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
// backward pass instead, on the gradients kept in the context: each
// instance averages those of its own module's parameters (several instances
// may be alive at once, each over parameters of its own; a pass that
// reaches several of them averages in the order they were constructed,
// which must be the same on every rank when they share a process group).
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

// Where the reducer delivers each averaged gradient at the end of a
// synchronized backward pass (before backward returns), once per parameter
// in module().parameters() order: `index` into that list, the parameter, and
// its average over the group, shaped like the parameter. `averaged` is a
// view of the reducer's bucket, valid only during the call: copy it to keep
// it. A sink other than the default takes over the write-back completely
// (.grad keeps whatever local accumulation put there), e.g. to route the
// averages into a distributed autograd context instead of .grad. Runs on
// the thread finishing backward, under the reducer's lock: it must not call
// back into its DistributedDataParallel.
using GradientSink =
    std::function<void(size_t index, const at::Tensor& param, const at::Tensor& averaged)>;
// The default: writes .grad (copies into an existing .grad, else sets it to
// a copy of the average).
GradientSink grad_field_sink();

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
  // Replaces where averaged gradients go (nullptr restores
  // grad_field_sink()). Not used inside a dist_autograd context, where the
  // averages replace the pass's gradients before they reach the context.
  void set_gradient_sink(GradientSink sink);

  // Parameter indices (into module().parameters()) of each bucket.
  std::vector<std::vector<size_t>> bucket_indices() const;
  // Observer of the reducer's events, for tests and tracing:
  // "grad <param index>", "launch <bucket>", "done".
  void set_event_observer(std::function<void(const std::string&)> observer);

  class Reducer;

 private:
  // Throws std::invalid_argument, on every rank, when the ranks' parameters
  // and buffers differ in number, dtype or shape.
  void check_replicas_match(const std::vector<at::Tensor>& state, absl::Duration timeout);
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  std::unique_ptr<Reducer> reducer_;
};

}  // namespace ddprpc::ddp
