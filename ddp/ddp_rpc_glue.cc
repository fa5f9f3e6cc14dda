#include "ddp/ddp_rpc_glue.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/zeros_like.h>
#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "autograd/dist_autograd.h"
#include "rpc/rpc.h"

namespace ddprpc::ddp {
namespace {

// gloo's rendezvous over the RPC agent's store, under a key prefix.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(rpc::Store& store, std::string prefix) : store_(store), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(prefix_ + key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    std::string v = store_.get(prefix_ + key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override {
    wait(keys, std::chrono::milliseconds(absl::ToInt64Milliseconds(store_.timeout())));
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_.wait(full, absl::Milliseconds(timeout.count()));
  }

 private:
  rpc::Store& store_;
  const std::string prefix_;
};

}  // namespace

class DistAutogradDdp {
 public:
  DistAutogradDdp(torch::nn::Module& module, int rank, int world_size) : world_size_(world_size) {
    auto agent = rpc::current_agent();
    GlooStore store(agent->store(), "ddp/trainers/");
    gloo::transport::tcp::attr attr(agent->options().listen_address.c_str());
    auto device = gloo::transport::tcp::CreateDevice(attr);
    context_ = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
    context_->setTimeout(std::chrono::seconds(300));
    context_->connectFullMesh(store, device);
    for (const auto& p : module.parameters()) params_.push_back(p);
    for (size_t i = 0; i < params_.size(); ++i) index_[params_[i].unsafeGetTensorImpl()] = i;
    // Same starting point on every replica.
    std::vector<at::Tensor> state = params_;
    for (const auto& b : module.buffers()) state.push_back(b);
    at::NoGradGuard no_grad;
    for (auto& t : state) {
      at::Tensor c = t.contiguous();
      gloo::BroadcastOptions opts(context_);
      opts.setRoot(0);
      opts.setOutput(c.data_ptr<float>(), c.numel());
      gloo::broadcast(opts);
      if (!c.is_same(t)) t.copy_(c);
    }
  }

  // The gradient hook: averages this module's gradients across replicas.
  void average(std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads) {
    std::vector<at::Tensor> flat(params_.size());
    std::vector<int64_t> where(params_.size(), -1);
    for (size_t i = 0; i < params.size(); ++i) {
      auto it = index_.find(params[i].unsafeGetTensorImpl());
      if (it == index_.end()) continue;
      where[it->second] = static_cast<int64_t>(i);
      if (grads[i].defined()) flat[it->second] = grads[i].reshape(-1);
    }
    // Every replica contributes every parameter, zeros where it had none.
    for (size_t j = 0; j < params_.size(); ++j) {
      if (!flat[j].defined()) flat[j] = at::zeros_like(params_[j]).reshape(-1);
    }
    at::Tensor bucket = at::cat(flat).contiguous();
    gloo::AllreduceOptions opts(context_);
    opts.setOutput(bucket.data_ptr<float>(), bucket.numel());
    void (*sum)(void*, const void*, const void*, size_t) = &gloo::sum<float>;
    opts.setReduceFunction(sum);
    // Recursive halving/doubling: log2(n) steps instead of the ring's
    // 2(n-1); on oversubscribed CPUs every step waits for a process to be
    // scheduled, so fewer steps win (8 trainers on 2 cores: ~18 vs ~28 ms).
    if ((world_size_ & (world_size_ - 1)) == 0) {
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::BCUBE);
    }
    try {
      gloo::allreduce(opts);
    } catch (const std::exception& e) {
      throw std::runtime_error(absl::StrCat("ddp: allreduce of gradients across ", world_size_,
                                            " trainers failed (did a trainer stop?): ", e.what()));
    }
    bucket.div_(world_size_);
    int64_t offset = 0;
    for (size_t j = 0; j < params_.size(); ++j) {
      const int64_t n = params_[j].numel();
      if (where[j] >= 0) grads[where[j]] = bucket.narrow(0, offset, n).view(params_[j].sizes());
      offset += n;
    }
  }

 private:
  const int world_size_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::vector<at::Tensor> params_;
  std::unordered_map<c10::TensorImpl*, size_t> index_;
};

std::shared_ptr<DistAutogradDdp> attach_to_dist_autograd(torch::nn::Module& module, int rank,
                                                         int world_size, const std::string& backend) {
  if (backend != "gloo") {
    throw std::invalid_argument("ddp: backend '" + backend +
                                "' is not available for CPU tensors here (use gloo)");
  }
  auto ddp = std::make_shared<DistAutogradDdp>(module, rank, world_size);
  std::weak_ptr<DistAutogradDdp> weak = ddp;
  dist_autograd::set_gradient_hook(
      [weak](dist_autograd::ContextId, std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads) {
        if (auto self = weak.lock()) self->average(params, grads);
      });
  return ddp;
}

}  // namespace ddprpc::ddp
