// RLlib's default PPO module shapes in libtorch:
// - MLP: obs -> Linear(obs,256) tanh -> Linear(256,256) tanh, a policy head
//   Linear(256, actions) (logits) and a value head Linear(256, 1);
//   CartPole-sized by default (4 observations, 2 actions).
// - CNN (Atari): 84x84x4 frames (NCHW [B,4,84,84]) -> Conv(4,16,8,stride 4,pad 2)
//   relu -> Conv(16,32,4,stride 2,pad 2) relu -> Conv(32,256,11) relu -> flatten
//   (256), with the same heads.
// forward_exploration(obs) = encoder + heads + a categorical sample.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <string>
#include <tuple>

namespace ddprpc::models {

enum class PolicyKind { kMlp, kCnn };

class PpoPolicyImpl : public torch::nn::Module {
 public:
  PpoPolicyImpl(PolicyKind kind, int64_t obs_dim, int64_t actions);
  // (logits [B, actions], value [B, 1])
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& obs);
  // Sampled actions [B] (Gumbel-max over the logits).
  at::Tensor forward_exploration(const at::Tensor& obs);
  // A random observation batch of the right shape.
  at::Tensor example_input(int64_t batch) const;

  const PolicyKind kind;
  const int64_t obs_dim, actions;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, pi{nullptr}, vf{nullptr};
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
};
TORCH_MODULE(PpoPolicy);

PpoPolicy make_mlp_policy(int64_t obs_dim = 4, int64_t actions = 2);
PpoPolicy make_cnn_policy(int64_t actions = 6);

// Categorical sample from logits (Gumbel-max: argmax(logits + Gumbel noise)).
at::Tensor sample_actions(const at::Tensor& logits);

std::string kind_name(PolicyKind kind);

}  // namespace ddprpc::models
