#include "models/chosen_log_probs.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/log.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <stdexcept>
#include <string>

namespace ddprpc::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class ChosenLogProbs : public torch::autograd::Function<ChosenLogProbs> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& probs,
                            const std::vector<int64_t>& actions) {
    const int64_t rows = probs.size(0), n = probs.size(1);
    at::Tensor out = at::empty({rows}, probs.options());
    const float* p = probs.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) o[r] = std::log(p[r * n + actions[r]]);
    ctx->save_for_backward({probs});
    ctx->saved_data["actions"] = actions;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor probs = ctx->get_saved_variables()[0];
    const c10::List<int64_t> actions = ctx->saved_data["actions"].toIntList();
    const at::Tensor g = grads[0].contiguous();
    const int64_t rows = probs.size(0), n = probs.size(1);
    at::Tensor dprobs = at::zeros_like(probs);
    const float* p = probs.data_ptr<float>();
    const float* gr = g.data_ptr<float>();
    float* d = dprobs.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = r * n + actions.get(r);
      d[at] = gr[r] / p[at];
    }
    return {dprobs, at::Tensor()};
  }
};

}  // namespace

at::Tensor chosen_log_probs(const at::Tensor& probs, const std::vector<int64_t>& actions) {
  if (probs.dim() != 2 || probs.size(0) != static_cast<int64_t>(actions.size())) {
    throw std::invalid_argument("chosen_log_probs: expected [rows, n] probabilities and " +
                                std::to_string(actions.size()) + " actions, got " +
                                std::to_string(probs.dim()) + "-D probabilities");
  }
  for (int64_t a : actions) {
    if (a < 0 || a >= probs.size(1)) {
      throw std::invalid_argument("chosen_log_probs: action " + std::to_string(a) +
                                  " outside [0, " + std::to_string(probs.size(1)) + ")");
    }
  }
  if (probs.scalar_type() != at::kFloat || !probs.is_contiguous() || !probs.device().is_cpu() ||
      probs.layout() != c10::kStrided) {
    const at::Tensor index = at::tensor(actions, at::kLong).view({-1, 1});
    return probs.gather(1, index.to(probs.device())).log().view({-1});
  }
  return ChosenLogProbs::apply(probs, actions);
}

}  // namespace ddprpc::models
