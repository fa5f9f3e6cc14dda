// batch_rpc's second half: batch CartPole REINFORCE (PyTorch's batch-RPC
// tutorial). One agent and world_size - 1 observers, each stepping its own
// CartPole-v1 (models/cartpole.h) and asking the agent for every action:
// one at a time (select_action) or batched (select_action_batch, async
// execution: the last observer to arrive runs the policy once for
// everyone).
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "benchmarks/batch_rpc_figures.h"

namespace ddprpc::benchmarks::batch_rpc {

struct CartpoleRun {
  int episodes = 10;
  int64_t steps = 100;  // per observer per episode
  int64_t seed = 543;
  double gamma = 1.0;  // discount factor
  double lr = 1e-2;    // Adam learning rate
  absl::Duration timeout = absl::Seconds(300);  // of each observer's episode call
};

// Rank 0 of a CartPole run, with workers "agent" (this process) and
// "observer<r>": batch mode, then without batching. Figures keyed
// "batch.*" and "nobatch.*": seconds, per-episode and running rewards,
// request, answer and action counts.
Figures run_cartpole(int world_size, const CartpoleRun& run);

// "observer<rank>".
std::string observer_name(int rank);

}  // namespace ddprpc::benchmarks::batch_rpc
