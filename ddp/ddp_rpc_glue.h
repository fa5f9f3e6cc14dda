// DDP inside distributed autograd (the hybrid DDP + RPC setup): a module's
// replicas on several trainers are kept identical by averaging their
// gradients across the trainers' process group in every dist_autograd
// backward pass, before the gradients land in the context (where the
// DistributedOptimizer finds them).
//
//   auto ddp = ddp::attach_to_dist_autograd(model.dense(), trainer_rank, trainers);
//
// The group's rendezvous uses the RPC agent's store (rpc::init_rpc first).
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <string>

namespace ddprpc::ddp {

class DistAutogradDdp;

// Broadcasts rank 0's parameters and buffers of `module` to every rank, then
// installs the gradient averaging; it stays active while the returned
// handle lives. backend: "gloo" (CPU tensors); "nccl" is not available in
// this CPU build and fails with a clear error.
std::shared_ptr<DistAutogradDdp> attach_to_dist_autograd(torch::nn::Module& module, int rank,
                                                         int world_size,
                                                         const std::string& backend = "gloo");

}  // namespace ddprpc::ddp
