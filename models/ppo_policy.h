// RLlib's default PPO module shapes in libtorch (eager):
// - MLP (CartPole-sized by default: 4 observations, 2 actions):
//   obs -> Linear(obs, 256) tanh -> Linear(256, 256) tanh (fcnet_hiddens
//   [256, 256]), a policy head Linear(256, actions) (logits) and a value head
//   Linear(256, 1).
// - CNN (Atari): 84x84x4 frames as NCHW [B, 4, 84, 84] -> RLlib's default
//   conv_filters [[16, [8, 8], 4], [32, [4, 4], 2], [256, [11, 11], 1]] with
//   relu ("same" padding for the first two: 21x21, 11x11, then 1x1) ->
//   flatten (256), with the same heads.
// forward_exploration(obs) = encoder + heads + a categorical sample of the
// logits (Gumbel-max), as RLlib's sampling does per env step.
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

// What a rollout needs per step: sampled actions [B] (int64), the action
// distribution inputs (logits [B, actions]) and the value estimates [B, 1].
struct PolicyOutput {
  at::Tensor actions, logits, value;
};

class PpoPolicyImpl : public torch::nn::Module {
 public:
  PpoPolicyImpl(PolicyKind kind, int64_t obs_dim, int64_t actions);
  // (logits [B, actions], value [B, 1])
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& obs);
  PolicyOutput forward_exploration(const at::Tensor& obs);
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

// Categorical sample from logits [B, A] (Gumbel-max: argmax over A of
// logits - log(-log(u)), u ~ U(0, 1] from the default generator).
at::Tensor sample_actions(const at::Tensor& logits);

// "mlp" or "cnn".
std::string kind_name(PolicyKind kind);

}  // namespace ddprpc::models
