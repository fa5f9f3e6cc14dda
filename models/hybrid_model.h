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

#include <cstdint>
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

 private:
  torch::nn::EmbeddingBag table_;
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
  // RRefs of every parameter: each table's (on its server), then the local
  // dense ones.
  std::vector<rpc::RRef<at::Tensor>> parameter_rrefs();

 private:
  const HybridModelOptions options_;
  std::vector<rpc::RRef<EmbeddingTable>> tables_;
  torch::nn::Sequential dense_;
};

}  // namespace ddprpc::models
