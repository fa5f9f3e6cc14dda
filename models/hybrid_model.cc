#include "models/hybrid_model.h"

#include "models/embedding_bag.h"
#include "models/linear.h"

#include <ATen/ops/cat.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/activation.h>

#include <stdexcept>
#include <variant>

#include "optim/distributed_optimizer.h"

namespace ddprpc::models {

EmbeddingTable::EmbeddingTable(int64_t num_embeddings, int64_t embedding_dim)
    : table_(torch::nn::EmbeddingBagOptions(num_embeddings, embedding_dim).mode(torch::kSum)),
      version_base_(table_->weight._version()) {}

int64_t EmbeddingTable::steps() {
  return steps_base_ + (static_cast<int64_t>(table_->weight._version()) - version_base_);
}

std::pair<at::Tensor, int64_t> EmbeddingTable::snapshot() {
  std::pair<at::Tensor, int64_t> out;
  optim::without_steps([&] {
    out.first = table_->weight.detach().clone();
    out.second = steps();
  });
  return out;
}

void EmbeddingTable::restore(const at::Tensor& weight, int64_t steps) {
  if (!weight.defined() || weight.sizes() != table_->weight.sizes()) {
    throw std::invalid_argument("EmbeddingTable::restore: a weight of another shape");
  }
  optim::without_steps([&] {
    torch::NoGradGuard no_grad;
    table_->weight.copy_(weight);
    steps_base_ = steps;
    version_base_ = table_->weight._version();
  });
}

at::Tensor EmbeddingTable::forward(at::Tensor indices, at::Tensor offsets) {
  const torch::nn::EmbeddingBagOptions& o = table_->options;
  // Dense gradients of a plain sum: one fused node (embedding_bag.h).
  if (!o.sparse() && !o.max_norm() && !o.padding_idx() && !o.include_last_offset() &&
      std::holds_alternative<torch::enumtype::kSum>(o.mode())) {
    return embedding_bag_sum_dense(table_->weight, indices, offsets);
  }
  return table_->forward(indices, offsets);
}

std::vector<rpc::RRef<at::Tensor>> EmbeddingTable::parameter_rrefs() {
  std::vector<rpc::RRef<at::Tensor>> out;
  for (const auto& p : table_->parameters()) out.emplace_back(p);
  return out;
}

void EmbeddingTable::set_sparse(bool sparse) { table_->options.sparse(sparse); }

static auto embedding_table_registration =
    rpc::register_class<EmbeddingTable>("ddprpc.models.EmbeddingTable")
        .constructor<int64_t, int64_t>()
        .method("forward", &EmbeddingTable::forward)
        .method("parameter_rrefs", &EmbeddingTable::parameter_rrefs)
        .method("set_sparse", &EmbeddingTable::set_sparse)
        .method("steps", &EmbeddingTable::steps);

torch::nn::Sequential make_dense(int64_t fc_in, DenseKernel kernel) {
  // models::Linear: torch::nn::Linear with its products on XNNPACK or
  // libtorch's kernel (linear.h).
  auto linear = [kernel](int64_t in, int64_t out) {
    Linear layer(in, out);
    layer->set_kernel(kernel);
    return layer;
  };
  return torch::nn::Sequential(linear(fc_in, 256), linear(256, 128), torch::nn::ReLU(),
                               linear(128, 64), linear(64, 32), linear(32, 8));
}

HybridModel::HybridModel(std::vector<rpc::RRef<EmbeddingTable>> tables, int64_t embedding_dim,
                         HybridModelOptions options)
    : options_(options),
      tables_(std::move(tables)),
      dense_(make_dense(static_cast<int64_t>(tables_.size()) * embedding_dim,
                        options.dense_kernel)) {
  apply_options(tables_);
}

void HybridModel::apply_options(const std::vector<rpc::RRef<EmbeddingTable>>& tables) {
  if (!options_.sparse) return;
  std::vector<rpc::Future<void>> set;
  for (const auto& table : tables) set.push_back(table.rpc_async(&EmbeddingTable::set_sparse, true));
  rpc::wait_all(set);
}

void HybridModel::set_tables(std::vector<rpc::RRef<EmbeddingTable>> tables) {
  if (tables.size() != tables_.size()) {
    throw std::invalid_argument("HybridModel::set_tables: another number of tables");
  }
  apply_options(tables);
  tables_ = std::move(tables);
}

at::Tensor HybridModel::forward(const at::Tensor& indices, const at::Tensor& offsets) {
  std::vector<at::Tensor> embedded;
  if (options_.lookups == HybridModelOptions::Lookups::kSequential) {
    for (const auto& table : tables_) {
      embedded.push_back(table.rpc_sync(&EmbeddingTable::forward, indices, offsets));
    }
  } else {
    std::vector<rpc::Future<at::Tensor>> lookups;
    lookups.reserve(tables_.size());
    rpc::SyncCallScope waited_here;  // this thread reads the replies
    for (const auto& table : tables_) {
      lookups.push_back(table.rpc_async(&EmbeddingTable::forward, indices, offsets));
    }
    embedded = rpc::wait_all(lookups);
  }
  return dense_->forward(at::cat(embedded, /*dim=*/1));
}

std::vector<rpc::RRef<at::Tensor>> HybridModel::parameter_rrefs() {
  std::vector<rpc::Future<std::vector<rpc::RRef<at::Tensor>>>> remote;
  for (const auto& table : tables_) {
    remote.push_back(table.rpc_async(&EmbeddingTable::parameter_rrefs));
  }
  std::vector<rpc::RRef<at::Tensor>> out;
  for (auto& params : rpc::wait_all(remote)) out.insert(out.end(), params.begin(), params.end());
  for (const auto& p : dense_->parameters()) out.emplace_back(p);
  return out;
}

}  // namespace ddprpc::models
