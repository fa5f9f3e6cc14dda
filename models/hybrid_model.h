// The hybrid model of the DDP + RPC benchmark (benchmarks/ddp_rpc.cc):
//
// - a sparse part: one EmbeddingBag(num_embeddings, dim, mode=sum) table on
//   each parameter server, created with rpc::remote<EmbeddingTable> and
//   reached by RRef;
// - a dense part, Linear(fc_in,256) -> Linear(256,128) -> ReLU ->
//   Linear(128,64) -> Linear(64,32) -> Linear(32,8), replicated on every
//   trainer (under DDP when a gradient averager is installed).
//
// forward(indices, offsets) looks every table up concurrently, concatenates
// the results (fc_in = tables * dim) and runs the dense part.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>

#include <cstdint>
#include <vector>

#include "rpc/rref.h"

namespace ddprpc::models {

// A sparse shard, living on a parameter server. Registered as the remote
// class "ddprpc.models.EmbeddingTable".
class EmbeddingTable {
 public:
  EmbeddingTable(int64_t num_embeddings, int64_t embedding_dim);
  at::Tensor forward(at::Tensor indices, at::Tensor offsets);
  // RRefs (owned here) of the table's parameters, for DistributedOptimizer.
  std::vector<rpc::RRef<at::Tensor>> parameter_rrefs();
  torch::nn::EmbeddingBag& module() { return table_; }

 private:
  torch::nn::EmbeddingBag table_;
};

torch::nn::Sequential make_dense(int64_t fc_in);

class HybridModel {
 public:
  HybridModel(std::vector<rpc::RRef<EmbeddingTable>> tables, int64_t embedding_dim);

  at::Tensor forward(const at::Tensor& indices, const at::Tensor& offsets);
  torch::nn::Sequential& dense() { return dense_; }
  const std::vector<rpc::RRef<EmbeddingTable>>& tables() const { return tables_; }
  // RRefs of every parameter: each table's (on its server), then the local
  // dense ones.
  std::vector<rpc::RRef<at::Tensor>> parameter_rrefs();

 private:
  std::vector<rpc::RRef<EmbeddingTable>> tables_;
  torch::nn::Sequential dense_;
};

}  // namespace ddprpc::models
