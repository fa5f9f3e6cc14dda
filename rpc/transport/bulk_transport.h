// The bulk path: large tensors between workers that reach each other over
// the wrapped transport (other hosts, or every peer when the same-host
// transport is off) leave the frame and are read by the receiver over TCP
// connections of their own, several per pair of workers, straight into the
// tensors that receive them.
//
// make_bulk_transport() wraps another transport (gRPC). Frames still go
// through it; a tensor of at least BulkOptions::min_bytes in a frame to a
// peer that runs a bulk path too is lent instead: the frame names it
// (wire::TensorMeta.lent) and the sender keeps a reference in a table, per
// peer and bounded in bytes (beyond the bound tensors travel in the frame).
// The receiver parses and checks the frame as any other, allocates each
// lent tensor, and pulls its bytes from the sender's bulk listener: one
// range per connection, each read straight into the tensor. The lend ends
// once the receiver has every byte (it says so), when the frame that
// carried it is answered, or after BulkOptions::lend_timeout (for a
// request, at its call's deadline if that is later).
//
// The same rules hold as on the wrapped transport: a bulk connection
// proves the job's token for the worker it names and the worker it opens
// to (internal/auth.h) before anything it asks is served, within the
// handshake timeout and a cap on connections not yet proven (the oldest
// give way); a pull may name only lends made to the worker it proved, and
// within their bytes, or its connection ends. A pull that fails (the
// lender is gone, refused the connection or the range, or stalled for
// BulkOptions::silence) fails that frame: a request is answered with an
// error (kUnavailable, naming the lender), a reply becomes one; the
// connections and the worker go on.
//
// Pulls run on threads of their own (internal/bulk_pull_pool.h), never on
// the thread that read the frame, which goes on reading: one pull per peer
// at a time, the peers taking turns, on up to BulkOptions::pull_threads
// threads. A request with lent tensors reaches the server's offload
// function (never the inline one) from the pull's thread once it has its
// bytes; a reply reaches its call likewise. A pull is bounded by
// BulkOptions::silence without progress, and by silence plus its bytes at
// 16 MiB/s in all. A channel's close or a server's shutdown drops the
// frames still being pulled for it.
//
// Pushes: where the lender may use BulkOptions::push_min_cpus CPUs or
// more, it does not wait for the pull. Once the frame is handed to the
// wrapped transport, it starts writing a lent tensor's ranges over
// connections of its own to the receiver's bulk listener (when they are
// open and idle; the first lend to a peer opens them in the background),
// and the frame says so (wire::TensorMeta.pushed). The receiver, as it
// checks the frame on the thread that read it, allocates the tensor and
// claims it (internal/bulk_claims.h); a push connection reads each range
// straight into the claimed tensor. A tensor whose ranges do not all start
// within BulkOptions::push_start_wait, or one of whose ranges breaks the
// rules, is pulled instead, once no range is being read into it. Push
// connections prove the job's token as pull connections do (for pushing,
// to the worker they open to); a range lands only in a tensor that a
// frame of the same proven worker named, of the size, ranges and index
// the frame implies, once; a range no frame claims within the silence
// limit, or one that breaks these rules, ends its connection. After the
// delivery the receiver releases the lend as after a pull. On fewer CPUs
// the pushed bytes and the frame that names them compete for the CPUs,
// and pulling is faster (docs/network-path.md).
//
// A lent tensor is not copied: the receiver reads the sender's memory as
// it is when the pull comes (within a round trip of the frame, usually),
// or the push writes it (just after the frame), as the wrapped transport
// reads it when it writes the frame. A tensor changed in place before its
// call completes may arrive changed.
//
// Pulled tensors get their memory from a cache of buffers that earlier
// pulled tensors gave back, pages still resident
// (internal/bulk_receive_cache.h, BulkOptions::receive_cache_bytes): a
// fresh multi-megabyte buffer's pages fault in one by one as the bytes
// arrive, which costs more than the transfer on a virtual machine.
//
// With TLS the bulk path is off: tensors stay on the wrapped transport's
// encrypted stream.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/time/time.h"
#include "rpc/transport/transport.h"

namespace ddprpc::rpc::transport {

struct BulkOptions {
  // Tensors at least this large are lent.
  uint64_t min_bytes = 256 << 10;
  // Connections a pull from one peer, or a push to it, is spread over.
  int streams = 3;
  // Bytes lent to one peer and not yet pulled.
  int64_t max_lent_bytes_per_peer = int64_t{1} << 30;
  // A lend not pulled by then ends (the receiver dropped its frame); a
  // request's lends last until its call's deadline (SendOptions::deadline)
  // when that is later.
  absl::Duration lend_timeout = absl::Seconds(120);
  // A pull, or the serving of one, that makes no progress this long fails.
  // (The agent uses its keepalive interval + timeout.)
  absl::Duration silence = absl::Seconds(30);
  // Threads that pull, all peers together (one pull per peer at a time). A
  // reply's delivery, which runs its call's callbacks, holds its thread.
  int pull_threads = 16;
  // Memory for the tensors pulls fill, kept resident between uses (a fresh
  // buffer's pages fault in one by one as the bytes arrive): at most this
  // many bytes of buffers no tensor uses, each kept at most the idle time.
  // 0: every tensor from the CPU allocator.
  int64_t receive_cache_bytes = int64_t{128} << 20;
  absl::Duration receive_cache_idle_time = absl::Seconds(10);
  // Pushes (see above): this worker takes pushed tensors, and pushes what
  // it lends where it may use push_min_cpus CPUs or more (on fewer, the
  // pushed bytes and the frame that names them compete for the CPUs, and
  // pulling is faster). A pushed tensor whose ranges have not all started
  // arriving push_start_wait after its frame was read is pulled instead.
  bool push = true;
  int push_min_cpus = 4;
  absl::Duration push_start_wait = absl::Milliseconds(100);
};

// Serves and connects through `inner`, lending large tensors on the bulk
// path (see above) between workers that both run one.
std::shared_ptr<Transport> make_bulk_transport(std::shared_ptr<Transport> inner,
                                               const BulkOptions& options = {});

}  // namespace ddprpc::rpc::transport
