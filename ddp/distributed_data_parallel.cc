#include "ddp/distributed_data_parallel.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "autograd/dist_autograd.h"

namespace ddprpc::ddp {

CommHook allreduce_hook() {
  return [](ProcessGroup& group, at::Tensor& bucket) {
    return group.allreduce({bucket}, ReduceOp::kAvg);
  };
}

namespace {

// Work that runs `then` once the inner work is waited for.
class ThenWork : public Work {
 public:
  ThenWork(std::shared_ptr<Work> inner, std::function<void()> then)
      : inner_(std::move(inner)), then_(std::move(then)) {}
  void wait(absl::Duration timeout) override {
    inner_->wait(timeout);
    absl::MutexLock lock(&mu_);
    if (then_) {
      then_();
      then_ = nullptr;
    }
  }
  bool completed() const override { return inner_->completed(); }

 private:
  std::shared_ptr<Work> inner_;
  absl::Mutex mu_;
  std::function<void()> then_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

CommHook fp16_compress_hook() {
  return [](ProcessGroup& group, at::Tensor& bucket) -> std::shared_ptr<Work> {
    at::Tensor half = bucket.to(at::kHalf);
    auto work = group.allreduce({half}, ReduceOp::kSum);
    const int size = group.size();
    at::Tensor target = bucket;
    return std::make_shared<ThenWork>(work, [half, target, size]() mutable {
      target.copy_(half.to(target.scalar_type()).div_(size));
    });
  };
}

GradientSink grad_field_sink() {
  return [](size_t, const at::Tensor& param, const at::Tensor& averaged) {
    at::NoGradGuard no_grad;
    at::Tensor& grad = param.mutable_grad();
    if (grad.defined()) {
      grad.copy_(averaged);
    } else {
      grad = averaged.clone();
    }
  };
}

class DistributedDataParallel::Reducer {
 public:
  Reducer(std::vector<at::Tensor> params, std::shared_ptr<ProcessGroup> group, DdpOptions options)
      : params_(std::move(params)), group_(std::move(group)), options_(options),
        hook_(allreduce_hook()), sink_(grad_field_sink()) {
    // Buckets in reverse parameter order (roughly the order of backward).
    const double mb = 1024.0 * 1024.0;
    double cap = options_.first_bucket_mb * mb, filled = 0;
    for (size_t k = params_.size(); k-- > 0;) {
      const at::Tensor& p = params_[k];
      const double bytes = static_cast<double>(p.numel() * p.element_size());
      if (buckets_.empty() || (filled > 0 && filled + bytes > cap) ||
          p.scalar_type() != params_[buckets_.back().params.front()].scalar_type()) {
        if (!buckets_.empty()) cap = options_.bucket_cap_mb * mb;
        buckets_.emplace_back();
        filled = 0;
      }
      Bucket& b = buckets_.back();
      slot_.push_back({buckets_.size() - 1, b.numel});
      b.params.push_back(k);
      b.numel += p.numel();
      filled += bytes;
    }
    std::reverse(slot_.begin(), slot_.end());  // slot_[k] for parameter k
    for (Bucket& b : buckets_) {
      b.flat = at::empty({b.numel}, params_[b.params.front()].options().requires_grad(false));
    }
    lists_in_place_ = std::all_of(buckets_.begin(), buckets_.end(), [this](const Bucket& b) {
      return group_->reduces_lists_in_place(b.numel * b.flat.element_size());
    });
    for (size_t k = 0; k < params_.size(); ++k) {
      hook_ids_.push_back(params_[k].register_hook([this, k](const at::Tensor& grad) {
        on_grad(k, grad);
        return grad;
      }));
    }
    dist_autograd_hook_ = dist_autograd::add_gradient_hook(
        [this](dist_autograd::ContextId, std::vector<at::Tensor>& params,
               std::vector<at::Tensor>& grads) { reduce_in_pass(params, grads); });
  }

  ~Reducer() {
    for (size_t k = 0; k < hook_ids_.size(); ++k) params_[k].remove_hook(hook_ids_[k]);
  }

  std::vector<std::vector<size_t>> bucket_indices() const {
    std::vector<std::vector<size_t>> out;
    for (const Bucket& b : buckets_) out.push_back(b.params);
    return out;
  }

  void set_sync(bool sync) {
    absl::MutexLock lock(&mu_);
    sync_ = sync;
  }
  void set_hook(CommHook hook) {
    absl::MutexLock lock(&mu_);
    hook_ = std::move(hook);
    default_hook_ = false;
  }
  void set_sink(GradientSink sink) {
    absl::MutexLock lock(&mu_);
    sink_ = sink ? std::move(sink) : grad_field_sink();
  }
  void set_observer(std::function<void(const std::string&)> observer) {
    absl::MutexLock lock(&mu_);
    observer_ = std::move(observer);
  }

  // Dist autograd: averages the gradients of this module's parameters among
  // `params` in place (called once per distributed backward pass).
  void reduce_in_pass(std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads) {
    std::vector<int64_t> where(params_.size(), -1);
    bool ours = false;
    for (size_t i = 0; i < params.size(); ++i) {
      for (size_t k = 0; k < params_.size(); ++k) {
        if (params[i].is_same(params_[k])) {
          where[k] = static_cast<int64_t>(i);
          ours = true;
        }
      }
    }
    // A pass that reaches none of the module's parameters (e.g. one that a
    // peer's backward started here for a table this worker owns) takes no
    // part: an allreduce of it would pair with another rank's real pass.
    if (!ours) return;
    absl::MutexLock lock(&mu_);
    if (!sync_) return;
    if (default_hook_ && lists_in_place_) return average_in_place(where, grads);
    // Fresh buckets each pass: the averages are handed out as views of
    // them (as gradient_as_bucket_view), which the context keeps.
    std::vector<at::Tensor> flats;
    for (const Bucket& b : buckets_) flats.push_back(at::empty_like(b.flat));
    for (size_t k = 0; k < params_.size(); ++k) {
      at::Tensor view = bucket_view(flats, k);
      if (where[k] >= 0 && grads[where[k]].defined()) {
        view.copy_(grads[where[k]].reshape(-1));
      } else {
        view.zero_();
      }
    }
    std::vector<std::shared_ptr<Work>> works;
    for (at::Tensor& flat : flats) works.push_back(hook_(*group_, flat));
    for (auto& w : works) w->wait(options_.timeout);
    for (size_t k = 0; k < params_.size(); ++k) {
      if (where[k] >= 0) grads[where[k]] = bucket_view(flats, k).view(params_[k].sizes());
    }
  }

 private:
  // reduce_in_pass with the default hook, where the group allreduces lists
  // without packing them: each bucket's gradients averaged in place as one
  // allreduce of their list, with no copy into a bucket first. A gradient that
  // something else refers to, is not laid out as its parameter, or is
  // missing (zeros) is averaged in a fresh tensor that then replaces it.
  void average_in_place(const std::vector<int64_t>& where, std::vector<at::Tensor>& grads)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<std::shared_ptr<Work>> works;
    for (const Bucket& b : buckets_) {
      std::vector<at::Tensor> parts;
      for (size_t k : b.params) {
        const at::Tensor& p = params_[k];
        at::Tensor* grad = where[k] >= 0 ? &grads[where[k]] : nullptr;
        if (grad != nullptr && grad->defined() && grad->layout() == at::kStrided &&
            !grad->_is_zerotensor() && !grad->is_neg() && !grad->is_conj() &&
            grad->scalar_type() == p.scalar_type() && grad->sizes() == p.sizes() &&
            grad->is_contiguous() && grad->use_count() == 1 && grad->storage().use_count() == 1) {
          parts.push_back(*grad);
          continue;
        }
        at::Tensor fresh = at::empty(p.sizes(), p.options().requires_grad(false));
        if (grad != nullptr && grad->defined()) {
          fresh.view(-1).copy_(grad->reshape(-1));
        } else {
          fresh.zero_();
        }
        if (grad != nullptr) *grad = fresh;
        parts.push_back(fresh);
      }
      // One bucket: the group may run it on this thread, which waits anyway.
      if (buckets_.size() == 1) {
        group_->allreduce_and_wait(std::move(parts), ReduceOp::kAvg, options_.timeout);
      } else {
        works.push_back(group_->allreduce(std::move(parts), ReduceOp::kAvg));
      }
    }
    for (auto& w : works) w->wait(options_.timeout);
  }

  struct Bucket {
    std::vector<size_t> params;  // indices into params_
    int64_t numel = 0;
    at::Tensor flat;
    size_t pending = 0;
    std::shared_ptr<Work> work;
  };
  struct Slot {
    size_t bucket;
    int64_t offset;
  };

  // Parameter k's part of its bucket, in `flats` (one per bucket).
  at::Tensor bucket_view(const std::vector<at::Tensor>& flats, size_t k) const {
    return flats[slot_[k].bucket].narrow(0, slot_[k].offset, params_[k].numel());
  }
  at::Tensor bucket_view(size_t k) const {
    return buckets_[slot_[k].bucket].flat.narrow(0, slot_[k].offset, params_[k].numel());
  }

  void notify(const std::string& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (observer_) observer_(event);
  }

  void on_grad(size_t k, const at::Tensor& grad) {
    if (dist_autograd::current_context_id() >= 0) return;  // reduce_in_pass does it
    absl::MutexLock lock(&mu_);
    if (!sync_) return;
    // A pass whose backward threw never reached finalize(): its callback
    // went with its graph task, and so did the token that callback held.
    if (in_pass_ && pass_token_.expired()) {
      notify("abandoned");
      in_pass_ = false;
    }
    if (!in_pass_) {
      in_pass_ = true;
      for (Bucket& b : buckets_) {
        b.pending = b.params.size();
        // An allreduce of a pass that failed before waiting for it may
        // still run on this bucket and write its result back: it keeps its
        // buffer, and this pass takes a new one.
        if (b.work && !b.work->completed()) b.flat = at::empty_like(b.flat);
        b.work = nullptr;
      }
      next_launch_ = 0;
      ready_.assign(params_.size(), false);
      auto token = std::make_shared<int>(0);
      pass_token_ = token;
      torch::autograd::Engine::get_default_engine().queue_callback(
          [this, token] { finalize(); });
    }
    notify(absl::StrCat("grad ", k));
    // What .grad will hold after accumulation: the earlier (no_sync) value plus this one.
    at::Tensor view = bucket_view(k);
    const at::Tensor& existing = params_[k].grad();
    if (existing.defined()) {
      at::add_out(view, existing.reshape(-1), grad.reshape(-1));
    } else {
      view.copy_(grad.reshape(-1));
    }
    if (ready_[k]) return;
    ready_[k] = true;
    --buckets_[slot_[k].bucket].pending;
    // Collectives must be issued in the same order on every rank: launch
    // buckets strictly in index order, each as soon as it and all before it
    // are full.
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
      launch(next_launch_++);
    }
  }

  void launch(size_t b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    notify(absl::StrCat("launch ", b));
    buckets_[b].work = hook_(*group_, buckets_[b].flat);
  }

  // End of backward: reduce what is left, wait, write the averages back.
  void finalize() {
    absl::MutexLock lock(&mu_);
    in_pass_ = false;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (buckets_[b].work) continue;
      if (!options_.find_unused_parameters) {
        throw std::runtime_error(
            "DistributedDataParallel: some parameters received no gradient in this backward "
            "pass; pass find_unused_parameters=true if the model does not use all of them");
      }
      for (size_t k : buckets_[b].params) {
        if (ready_[k]) continue;
        const at::Tensor& existing = params_[k].grad();
        if (existing.defined()) {
          bucket_view(k).copy_(existing.reshape(-1));
        } else {
          bucket_view(k).zero_();
        }
      }
      launch(b);
    }
    for (Bucket& b : buckets_) b.work->wait(options_.timeout);
    at::NoGradGuard no_grad;
    for (size_t k = 0; k < params_.size(); ++k) {
      sink_(k, params_[k], bucket_view(k).view(params_[k].sizes()));
    }
    notify("done");
  }

  const std::vector<at::Tensor> params_;
  const std::shared_ptr<ProcessGroup> group_;
  const DdpOptions options_;
  // Whether the group allreduces every bucket's list of tensors without
  // packing them (ProcessGroup::reduces_lists_in_place); set by the
  // constructor.
  bool lists_in_place_ = false;
  std::vector<Bucket> buckets_;
  std::vector<Slot> slot_;
  std::vector<unsigned> hook_ids_;

  absl::Mutex mu_;
  // State below is protected by mu_.
  CommHook hook_ ABSL_GUARDED_BY(mu_);
  bool default_hook_ ABSL_GUARDED_BY(mu_) = true;  // hook_ is allreduce_hook()
  GradientSink sink_ ABSL_GUARDED_BY(mu_);
  std::function<void(const std::string&)> observer_ ABSL_GUARDED_BY(mu_);
  bool sync_ ABSL_GUARDED_BY(mu_) = true;
  bool in_pass_ ABSL_GUARDED_BY(mu_) = false;
  // Held by the pass's finalize() callback, which lives as long as its
  // graph task: expired while in_pass_, that pass failed.
  std::weak_ptr<int> pass_token_ ABSL_GUARDED_BY(mu_);
  size_t next_launch_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<bool> ready_ ABSL_GUARDED_BY(mu_);
  // Last, so destroyed first: no pass calls reduce_in_pass once the rest
  // of the reducer is going.
  dist_autograd::GradientHookHandle dist_autograd_hook_;
};

namespace {

// FNV-1a over the count, dtypes and shapes of `state`.
int64_t fingerprint(const std::vector<at::Tensor>& state) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<int64_t>(state.size()));
  for (const at::Tensor& t : state) {
    mix(static_cast<int64_t>(t.scalar_type()));
    mix(t.dim());
    for (int64_t s : t.sizes()) mix(s);
  }
  return static_cast<int64_t>(h);
}

}  // namespace

// Replicas whose parameters and buffers differ in number, dtype or shape
// would broadcast and allreduce buffers of different sizes: Gloo's threads
// end the process on such a message, or the ranks go on apart. Every rank
// checks first, with an allgather of fixed size.
void DistributedDataParallel::check_replicas_match(const std::vector<at::Tensor>& state,
                                                   absl::Duration timeout) {
  const int n = group_->size();
  if (n < 2) return;
  at::Tensor mine = at::empty({2}, at::kLong);
  mine[0] = static_cast<int64_t>(state.size());
  mine[1] = fingerprint(state);
  std::vector<at::Tensor> all;
  for (int r = 0; r < n; ++r) all.push_back(at::empty({2}, at::kLong));
  group_->allgather(all, mine)->wait(timeout);
  for (int r = 0; r < n; ++r) {
    if (at::equal(all[r], all[0])) continue;
    throw std::invalid_argument(absl::StrCat(
        "DistributedDataParallel (rank ", group_->rank(), " of ", n, "): rank ", r,
        "'s model has ", all[r][0].item<int64_t>(), " parameters and buffers, rank 0's ",
        all[0][0].item<int64_t>(),
        all[r][0].item<int64_t>() == all[0][0].item<int64_t>()
            ? ", with other dtypes or shapes"
            : "",
        ": every replica must be the same model (and broadcast_buffers the same)"));
  }
}

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 DdpOptions options)
    : module_(std::move(module)), group_(std::move(group)) {
  // Every replica starts from rank 0's parameters and buffers.
  std::vector<at::Tensor> state;
  {
    at::NoGradGuard no_grad;
    for (const auto& p : module_->parameters()) state.push_back(p.detach());
    if (options.broadcast_buffers) {
      for (const auto& b : module_->buffers()) state.push_back(b);
    }
  }
  check_replicas_match(state, options.timeout);
  if (!state.empty()) group_->broadcast(state, 0)->wait(options.timeout);
  reducer_ = std::make_unique<Reducer>(module_->parameters(), group_, options);
}

DistributedDataParallel::~DistributedDataParallel() = default;

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel* ddp) : ddp_(ddp) {
  ddp_->reducer_->set_sync(false);
}

DistributedDataParallel::NoSync::~NoSync() {
  if (ddp_) ddp_->reducer_->set_sync(true);
}

void DistributedDataParallel::register_comm_hook(CommHook hook) {
  reducer_->set_hook(std::move(hook));
}

void DistributedDataParallel::set_gradient_sink(GradientSink sink) {
  reducer_->set_sink(std::move(sink));
}

std::vector<std::vector<size_t>> DistributedDataParallel::bucket_indices() const {
  return reducer_->bucket_indices();
}

void DistributedDataParallel::set_event_observer(std::function<void(const std::string&)> observer) {
  reducer_->set_observer(std::move(observer));
}

}  // namespace ddprpc::ddp
