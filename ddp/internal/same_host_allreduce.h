// Allreduce among processes of one host by cross-process reads
// (process_vm_readv) instead of the network: each of n ranks reduces its
// 1/n of the buffer from the peers' copies into its own, then copies the
// peers' reduced parts into the rest of its buffer. Every byte crosses
// once per phase, with no socket, no kernel buffer and no extra copy.
//
// The Gloo group sets it up once (connect, collective): every rank
// publishes its pid and a random nonce, and reads every other rank's nonce
// back. Only when every rank read every other's correctly (same host,
// ptrace rules allow it, and willing: ProcessGroupOptions::same_host_allreduce) is
// it used, by all ranks alike. Peers are the job's own ranks, which Gloo
// trusts already; nothing is ever written into another process.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "ddp/internal/same_host_common.h"

namespace gloo {
class Context;
}

namespace ddprpc::ddp::internal {

class SameHostAllreduce {
 public:
  // Allreduces of fewer bytes keep Gloo's algorithms (latency-bound there).
  static constexpr int64_t kMinBytes = int64_t{1} << 20;

  // Collective over `context` (every rank calls it, in the same order as
  // the group's other operations). nullptr when some rank cannot take part.
  static std::unique_ptr<SameHostAllreduce> connect(const std::shared_ptr<gloo::Context>& context,
                                                    bool willing);

  // Collective: `flat` (contiguous, the same numel and dtype on every rank:
  // float, double, int64, int32 or half) becomes the reduction of every
  // rank's. Throws std::runtime_error when a peer cannot be read (it died).
  void run(at::Tensor& flat, Reduction op);

  // Allreduces this process ran this way (for tests and reports).
  static int64_t runs();

 private:
  SameHostAllreduce(std::shared_ptr<gloo::Context> context, std::vector<int64_t> pids);
  // Reads `bytes` from `address` in rank `peer` into `out`.
  void read(int peer, uint64_t address, void* out, size_t bytes) const;
  void barrier() const;

  const std::shared_ptr<gloo::Context> context_;
  const std::vector<int64_t> pids_;  // by rank
  at::Tensor scratch_;               // peer data waiting to be reduced
};

}  // namespace ddprpc::ddp::internal
