// The hybrid model of the DDP + RPC benchmark (benchmarks/ddp_rpc.cc):
//
// - a sparse part: one EmbeddingBag(num_embeddings, dim, mode=sum) table on
//   each parameter server, created with rpc::remote<EmbeddingTable> and
//   reached by RRef;
// - a dense part, Linear(fc_in,256) -> Linear(256,128) -> ReLU ->
//   Linear(128,64) -> Linear(64,32) -> Linear(32,8), replicated on every
//   trainer (under DDP when a gradient averager is installed).
//
// forward(indices, offsets) looks every table up (concurrently by default),
// concatenates the results (fc_in = tables * dim) and runs the dense part.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "models/linear.h"
#include "rpc/rref/rref.h"

namespace ddprpc::models {

// A sparse shard, living on a parameter server. Registered as the remote
// class "ddprpc.models.EmbeddingTable".
class EmbeddingTable {
 public:
  EmbeddingTable(int64_t num_embeddings, int64_t embedding_dim);
  at::Tensor forward(at::Tensor indices, at::Tensor offsets);
  // RRefs (owned here) of the table's parameters, for DistributedOptimizer.
  std::vector<rpc::RRef<at::Tensor>> parameter_rrefs();
  // With `sparse`, backward gives the weight a sparse (COO) gradient naming
  // only the rows a batch looked up, and an SGD step touches only those;
  // otherwise a dense one of the whole table's size (as nn.EmbeddingBag's
  // sparse=True/False).
  void set_sparse(bool sparse);
  torch::nn::EmbeddingBag& module() { return table_; }

  // Optimizer steps applied to the weight: changes made in place since the
  // table was built (an optimizer's step makes one), plus the steps the
  // last restore() said it holds.
  int64_t steps();
  // A copy of the weight and its steps(), taken between optimizer steps
  // (optim::without_steps).
  std::pair<at::Tensor, int64_t> snapshot();
  // Overwrites the weight with `weight` (same shape), which is taken to
  // hold `steps` optimizer steps.
  void restore(const at::Tensor& weight, int64_t steps);

 private:
  torch::nn::EmbeddingBag table_;
  // steps() when the weight's version was version_base_; written only
  // between optimizer steps.
  std::atomic<int64_t> steps_base_{0};
  std::atomic<int64_t> version_base_{0};
};

// The dense stack for `fc_in` inputs, its Linear layers on `kernel`.
torch::nn::Sequential make_dense(int64_t fc_in, DenseKernel kernel = DenseKernel::kXnnpack);

struct HybridModelOptions {
  // The tables' gradients: sparse (EmbeddingTable::set_sparse) or dense.
  // Applied to the tables when the model is built.
  bool sparse = false;
  // How forward() reaches the tables: all at once (rpc_async to every
  // server, then wait for every reply), or one after another (rpc_sync
  // each, the order of PyTorch's original benchmark).
  enum class Lookups { kConcurrent, kSequential };
  Lookups lookups = Lookups::kConcurrent;
  DenseKernel dense_kernel = DenseKernel::kXnnpack;
};

class HybridModel {
 public:
  HybridModel(std::vector<rpc::RRef<EmbeddingTable>> tables, int64_t embedding_dim,
              HybridModelOptions options = {});

  at::Tensor forward(const at::Tensor& indices, const at::Tensor& offsets);
  torch::nn::Sequential& dense() { return dense_; }
  const std::vector<rpc::RRef<EmbeddingTable>>& tables() const { return tables_; }
  // Looks up `tables` from now on (as many as before, of the same shape:
  // a shard restored on another server); applies the sparse option to them.
  void set_tables(std::vector<rpc::RRef<EmbeddingTable>> tables);
  // RRefs of every parameter: each table's (on its server), then the local
  // dense ones.
  std::vector<rpc::RRef<at::Tensor>> parameter_rrefs();

 private:
  // The tables' gradients as options_ say (sparse).
  void apply_options(const std::vector<rpc::RRef<EmbeddingTable>>& tables);

  const HybridModelOptions options_;
  std::vector<rpc::RRef<EmbeddingTable>> tables_;
  torch::nn::Sequential dense_;
};

}  // namespace ddprpc::models
