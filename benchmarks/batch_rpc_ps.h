// batch_rpc's first half: a batch-updating parameter server (PyTorch's
// batch-RPC tutorial). The PS's update_and_fetch_model returns an
// rpc::Future (async execution): each trainer's call adds its gradients and
// frees its callee thread; the last trainer to arrive runs the optimizer
// step and completes the shared future, which answers every pending call
// with the new model. Trainers train a small CNN on random 3x32x32 images
// (batch 20, 30 classes, MSE against one-hot labels).
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "benchmarks/batch_rpc_figures.h"

namespace ddprpc::benchmarks::batch_rpc {

// The trainers' model and data: images of 3 x kImageSize x kImageSize in
// batches of kBatchSize, kNumClasses classes.
constexpr int64_t kNumClasses = 30, kBatchSize = 20, kImageSize = 32;

struct PsRun {
  int64_t warmup = 3;  // iterations per trainer before measuring
  int64_t iters = 30;  // measured iterations per trainer
  double lr = 0.001;   // the PS's SGD learning rate (momentum 0.9)
  int64_t seed = 543;
  // Also run update_and_fetch_model without async execution (the call waits
  // on the future in its callee thread).
  bool blocking = true;
  absl::Duration timeout = absl::Seconds(300);  // of each trainer's training call
};

// Rank 0 of a PS run, with workers "ps" (this process) and "trainer<i>":
// one run with async execution, then (with `blocking`) one without, each
// with a fresh PS and fresh trainers. Figures keyed "async.*" and
// "blocking.*": updates/s, requests and answers, the PS's busy callee
// threads.
Figures run_ps(int trainers, const PsRun& run);

// "trainer<i>".
std::string trainer_name(int i);

}  // namespace ddprpc::benchmarks::batch_rpc
