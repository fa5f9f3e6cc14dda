// The autograd nodes that stand for an RPC in the local graphs.
#pragma once

#include <torch/csrc/autograd/function.h>

#include <cstdint>

namespace ddprpc::dist_autograd::internal {

// On the sender: its next edges lead to the sent tensors' graphs. Backward
// starts here with the gradients the receiver sent back, already on the
// devices of the tensors that were sent (propagate moves them there).
class SendRpcBackward : public torch::autograd::Node {
 public:
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    return std::move(grads);
  }
  std::string name() const override { return "SendRpcBackward"; }
};

// On the receiver: the grad_fn of the received tensors. It is never run:
// the local pass captures the gradients flowing into it and sends them to
// worker `src` for send function `message_id`.
class RecvRpcBackward : public torch::autograd::Node {
 public:
  RecvRpcBackward(int src, int64_t message_id) : src(src), message_id(message_id) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&&) override { return {}; }
  std::string name() const override { return "RecvRpcBackward"; }
  const int src;
  const int64_t message_id;
};

}  // namespace ddprpc::dist_autograd::internal
