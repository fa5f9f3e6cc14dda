// Copies from another process's memory (process_vm_readv) into this one's.
//
// read_remote() copies `n` bytes at address `remote` of process `pid` to
// `dst`. A read of at least kSplitCopyBytes is shared with a helper thread
// of this process: both copy 256 KiB chunks of it in turn until none is
// left, so that a large tensor crosses on two cores when two are free, and
// the caller never waits for more than the helper's current chunk. When the
// helper shares another thread's read, or this process was forked from the
// one that started it, the caller copies everything itself.
//
// Errors: Unavailable when the process is gone, DataLoss when its memory
// cannot be read or ends early. Thread-safe.
#ifndef DDPRPC_RPC_TRANSPORT_INTERNAL_CROSS_MEMORY_H_
#define DDPRPC_RPC_TRANSPORT_INTERNAL_CROSS_MEMORY_H_

#include <sys/types.h>

#include <cstdint>

#include "absl/status/status.h"

namespace ddprpc::rpc::transport::cross_memory {

inline constexpr uint64_t kSplitCopyBytes = uint64_t{1} << 20;

absl::Status read_remote(pid_t pid, void* dst, uint64_t remote, uint64_t n);

// Reads shared with the helper thread since the process started (tests).
int64_t split_copies();

}  // namespace ddprpc::rpc::transport::cross_memory

#endif  // DDPRPC_RPC_TRANSPORT_INTERNAL_CROSS_MEMORY_H_
