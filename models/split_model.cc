#include "models/split_model.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/embedding_bag.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sin.h>

namespace ddprpc::models {

at::Tensor deterministic_param(std::vector<int64_t> shape, double phase) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return at::sin(at::arange(n, at::kFloat) * 0.37 + phase).reshape(shape).mul(0.5).requires_grad_(true);
}

at::Tensor embedding_bag_sum(const at::Tensor& weight, const at::Tensor& indices,
                             const at::Tensor& offsets) {
  return std::get<0>(at::embedding_bag(weight, indices, offsets, false, /*mode=sum*/ 0));
}

RemoteEmbedding::RemoteEmbedding(int64_t rows, int64_t dim)
    : weight_(deterministic_param({rows, dim}, kPhase)) {}

at::Tensor RemoteEmbedding::forward(at::Tensor indices, at::Tensor offsets) {
  return embedding_bag_sum(weight_, indices, offsets);
}

std::vector<rpc::RRef<at::Tensor>> RemoteEmbedding::parameters() {
  return {rpc::RRef<at::Tensor>(weight_)};
}

RemoteLinear::RemoteLinear(int64_t in, int64_t out)
    : weight_(deterministic_param({out, in}, kWeightPhase)),
      bias_(deterministic_param({out}, kBiasPhase)) {}

at::Tensor RemoteLinear::forward(at::Tensor x) { return at::linear(x, weight_, bias_); }

std::vector<rpc::RRef<at::Tensor>> RemoteLinear::parameters() {
  return {rpc::RRef<at::Tensor>(weight_), rpc::RRef<at::Tensor>(bias_)};
}

static auto embedding_registration =
    rpc::register_class<RemoteEmbedding>("ddprpc.models.RemoteEmbedding")
        .constructor<int64_t, int64_t>()
        .method("forward", &RemoteEmbedding::forward)
        .method("parameters", &RemoteEmbedding::parameters);
static auto linear_registration = rpc::register_class<RemoteLinear>("ddprpc.models.RemoteLinear")
                                      .constructor<int64_t, int64_t>()
                                      .method("forward", &RemoteLinear::forward)
                                      .method("parameters", &RemoteLinear::parameters);

}  // namespace ddprpc::models
