// A tiny model split across workers, used by the distributed-autograd test
// and benchmark: an embedding bag on one worker, a linear layer on another,
// the loss on the caller. Parameters are deterministic (the same in every
// process), so a local replica can be compared with the distributed one.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "rpc/rref/rref.h"

namespace ddprpc::models {

// sin-based values in [-0.5, 0.5]; requires grad.
at::Tensor deterministic_param(std::vector<int64_t> shape, double phase);
at::Tensor embedding_bag_sum(const at::Tensor& weight, const at::Tensor& indices,
                             const at::Tensor& offsets);

// Remote class "ddprpc.models.RemoteEmbedding".
class RemoteEmbedding {
 public:
  RemoteEmbedding(int64_t rows, int64_t dim);
  at::Tensor forward(at::Tensor indices, at::Tensor offsets);
  std::vector<rpc::RRef<at::Tensor>> parameters();
  static constexpr double kPhase = 0.1;

 private:
  at::Tensor weight_;
};

// Remote class "ddprpc.models.RemoteLinear".
class RemoteLinear {
 public:
  RemoteLinear(int64_t in, int64_t out);
  at::Tensor forward(at::Tensor x);
  std::vector<rpc::RRef<at::Tensor>> parameters();
  static constexpr double kWeightPhase = 0.7, kBiasPhase = 1.3;

 private:
  at::Tensor weight_, bias_;
};

}  // namespace ddprpc::models
