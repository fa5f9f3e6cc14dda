#include "models/ppo_policy.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/log.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/tanh.h>

namespace ddprpc::models {

PpoPolicyImpl::PpoPolicyImpl(PolicyKind kind, int64_t obs_dim, int64_t actions)
    : kind(kind), obs_dim(obs_dim), actions(actions) {
  const int64_t hidden = 256;
  if (kind == PolicyKind::kMlp) {
    fc1 = register_module("fc1", torch::nn::Linear(obs_dim, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, hidden));
  } else {
    using torch::nn::Conv2dOptions;
    conv1 = register_module("conv1", torch::nn::Conv2d(Conv2dOptions(4, 16, 8).stride(4).padding(2)));
    conv2 = register_module("conv2", torch::nn::Conv2d(Conv2dOptions(16, 32, 4).stride(2).padding(2)));
    conv3 = register_module("conv3", torch::nn::Conv2d(Conv2dOptions(32, hidden, 11).stride(1)));
  }
  pi = register_module("pi", torch::nn::Linear(hidden, actions));
  vf = register_module("vf", torch::nn::Linear(hidden, 1));
}

std::tuple<at::Tensor, at::Tensor> PpoPolicyImpl::forward(const at::Tensor& obs) {
  at::Tensor h;
  if (kind == PolicyKind::kMlp) {
    h = at::tanh(fc2->forward(at::tanh(fc1->forward(obs))));
  } else {
    h = at::relu(conv3->forward(at::relu(conv2->forward(at::relu(conv1->forward(obs))))));
    h = h.flatten(1);
  }
  return {pi->forward(h), vf->forward(h)};
}

PolicyOutput PpoPolicyImpl::forward_exploration(const at::Tensor& obs) {
  auto [logits, value] = forward(obs);
  return {sample_actions(logits), logits, value};
}

at::Tensor PpoPolicyImpl::example_input(int64_t batch) const {
  return kind == PolicyKind::kMlp ? at::randn({batch, obs_dim}) : at::rand({batch, 4, 84, 84});
}

PpoPolicy make_mlp_policy(int64_t obs_dim, int64_t actions) {
  return PpoPolicy(PolicyKind::kMlp, obs_dim, actions);
}

PpoPolicy make_cnn_policy(int64_t actions) { return PpoPolicy(PolicyKind::kCnn, 84, actions); }

at::Tensor sample_actions(const at::Tensor& logits) {
  at::Tensor u = at::rand(logits.sizes(), logits.options()).clamp_(1e-10, 1.0);
  return at::argmax(logits - at::log(-at::log(u)), /*dim=*/1);
}

std::string kind_name(PolicyKind kind) { return kind == PolicyKind::kMlp ? "mlp" : "cnn"; }

}  // namespace ddprpc::models
