// Collectives among a fixed group of processes, mirroring
// torch.distributed's ProcessGroup: every operation is asynchronous and
// returns a Work; Work::wait(timeout) rethrows the operation's error or
// fails when the timeout passes. Operations run in the order they are
// issued, the same order on every rank.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "rpc/core/security.h"

namespace ddprpc::rpc {
class Store;
}

namespace ddprpc::ddp {

enum class ReduceOp { kSum, kAvg, kMin, kMax };

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until done; throws std::runtime_error naming the operation on
  // failure or when `timeout` passes first.
  virtual void wait(absl::Duration timeout = absl::InfiniteDuration()) = 0;
  virtual bool completed() const = 0;
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;

  // In place, on every tensor (dense, contiguous, float/double/int/long).
  virtual std::shared_ptr<Work> allreduce(std::vector<at::Tensor> tensors,
                                          ReduceOp op = ReduceOp::kSum) = 0;
  // Every tensor takes root's value.
  virtual std::shared_ptr<Work> broadcast(std::vector<at::Tensor> tensors, int root = 0) = 0;
  // outputs[r] receives rank r's input; outputs must hold size() tensors
  // shaped like input.
  virtual std::shared_ptr<Work> allgather(std::vector<at::Tensor> outputs, at::Tensor input) = 0;
  virtual std::shared_ptr<Work> barrier() = 0;

  // allreduce(tensors, op)->wait(timeout). A group may run it on the calling
  // thread when none of its operations is queued or running, with no hop to
  // the thread that runs them: for callers that would wait at once.
  virtual void allreduce_and_wait(std::vector<at::Tensor> tensors, ReduceOp op,
                                  absl::Duration timeout) {
    allreduce(std::move(tensors), op)->wait(timeout);
  }

  // Whether allreduce() of several tensors totalling `bytes` (one dtype)
  // reads and writes the tensors themselves, with no buffer of their
  // concatenation in between: a caller holding separate tensors then gains
  // nothing by packing them into one first. False unless a group says so.
  virtual bool reduces_lists_in_place(int64_t bytes) const { return false; }
};

struct ProcessGroupOptions {
  // Deadline of each collective (and of the rendezvous).
  absl::Duration timeout = absl::Seconds(300);
  // Address this process listens on for its peers.
  std::string listen_address = "127.0.0.1";
  // Gloo groups whose ranks share a host reduce through shared memory and
  // cross-process reads instead of Gloo's TCP algorithms where that is
  // faster. A group uses them only if every rank agrees: one rank with
  // false keeps the whole group on Gloo's.
  bool same_host_allreduce = true;
  // Those same-host barriers look for their peers for up to this long
  // before they sleep, while the group has a CPU per rank (at most 10 ms).
  // Zero by default: spinning costs CPU time the program may want.
  absl::Duration max_spin = absl::ZeroDuration();
  // Between hosts, allreduces of 256 KiB and more run a streaming ring
  // over TCP connections of the group's own instead of the synchronous
  // halving-doubling (up to 1 MiB) and Gloo's ring (above): the
  // connections are made, and proved with the job's secret, when the group
  // is built. A group uses it only if every rank agrees and listens on an
  // IPv4 address; otherwise, or with false, Gloo's ring.
  bool tcp_ring = true;
  // Rings (each with connections of its own) a ring allreduce is striped
  // over, each taking its share at once on threads of its own; the group
  // uses the fewest any rank asks for. 0: 3 where this process may use 8
  // CPUs or more, else 1 (more rings only take turns on fewer CPUs).
  int tcp_ring_streams = 0;

  // For init_process_group, which hosts and reaches its own store: the
  // job's secret and TLS material (what this leaves empty comes from the
  // environment, rpc::Security::with_environment_defaults). The token also
  // proves every Gloo pair and ring connection (docs/security.md).
  rpc::Security security;
  // init_process_group refuses to serve or reach its store, or listen, on
  // an address other than loopback with neither a token nor TLS, unless
  // this is set: anyone who can reach the port could then join the group.
  bool allow_insecure = false;
};

// Gloo over TCP. Rendezvous through `store` under `prefix`, so several
// groups (and the RPC agent) can share one store.
std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<rpc::Store> store,
                                              const std::string& prefix, int rank, int size,
                                              ProcessGroupOptions options = {});

// NCCL (GPU collectives), built when the CUDA toolkit is present; throws
// when it is not built in or no GPU is visible. Same rendezvous as Gloo.
std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<rpc::Store> store,
                                              const std::string& prefix, int rank, int size,
                                              ProcessGroupOptions options = {});
// True when the NCCL backend is built in and a GPU is visible.
bool nccl_available();
// GPUs visible to the NCCL backend (0 when it is not built in). Rank r of a
// group uses GPU r % nccl_devices(); NCCL refuses two ranks on one GPU.
int nccl_devices();

// "gloo" or "nccl" with its own store: init_method "tcp://host:port" (rank 0 hosts the
// store there) or "env://" (MASTER_ADDR, MASTER_PORT; rank/size < 0 read
// RANK and WORLD_SIZE). Throws std::invalid_argument for a bad argument,
// or for a store or listen address off loopback with no token or TLS in
// options.security or the environment (unless options.allow_insecure).
std::shared_ptr<ProcessGroup> init_process_group(const std::string& backend,
                                                 const std::string& init_method = "env://",
                                                 int rank = -1, int size = -1,
                                                 ProcessGroupOptions options = {});

}  // namespace ddprpc::ddp
