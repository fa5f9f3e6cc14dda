// The same-host transport: workers of one host (same boot, same network and
// PID namespaces) exchange frames over a Unix-domain stream socket in the
// abstract namespace, and large tensors cross once: the receiver copies
// them from the sender's memory straight into the new tensor
// (process_vm_readv, "cross-memory attach"), then acknowledges so that the
// sender lets them go. Small tensors travel inline on the socket, so a
// small message wakes the receiving thread once; after the handshake a
// reader takes what the socket holds (64 KiB at most) in one read, so a
// small message costs one read and messages that came together one for all.
//
// A server's connections are read by one thread at a time, which waits on
// all of them (epoll) and runs their requests one after another: requests
// that come while it is busy, from any caller, cost no thread wake-up. A
// request that keeps it for ServerLimits::inline_handoff (it blocks), or a
// frame that stops halfway, hands reading on to another thread; a caller
// that keeps its connection full gets its share in turn with the others.
//
// make_same_host_transport() wraps another transport (gRPC): its servers
// listen on both, and a channel to a peer whose endpoint names this host
// goes over the socket, to any other peer (or when the socket cannot be
// opened) over the wrapped transport.
//
// A process of another user is refused as it connects (the kernel names
// its uid), unless ServerLimits::allow_other_uids. The acceptor thread
// runs every handshake itself, reading each socket as its bytes come,
// within ServerLimits' handshake_timeout and caps on connections not yet
// proven (all together and per uid; the oldest give way): connections
// that say nothing cost no thread. Out of descriptors, the acceptor takes
// each new connection off the queue and closes it, and the connections
// open go on; a /proc read that fails says nothing of a peer's process.
//
// The same rules hold as on gRPC: a connection proves the job's token for
// the worker it names before anything it sends is read (without a token
// but with TLS, the peer must run as this process's user); every frame is
// parsed and validated by the wire codec within ServerLimits; a server
// stops reading a connection with too many requests unanswered or reply
// bytes unacknowledged; a peer whose process has stopped (SIGSTOP) for
// keepalive_timeout, or is gone, ends its connections as unreachable.
// Cross-memory reads that the kernel refuses (ptrace restrictions) are
// found when a connection opens; its tensors then travel inline.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "rpc/transport/transport.h"

namespace ddprpc::rpc::transport {

// Tensors at least this large are copied from the sender's memory rather
// than written to the socket (when the kernel allows it).
inline constexpr uint64_t kCrossMemoryMinBytes = 32 << 10;

// This process's host: boot id and network and PID namespaces. Workers
// with the same identity can reach each other through the same-host path.
const std::string& host_identity();

// Serves and connects through `fallback` and, for peers on this host, the
// same-host path (see above), with `options` (transport.h).
std::shared_ptr<Transport> make_same_host_transport(std::shared_ptr<Transport> fallback,
                                                    const TransportOptions& options = {});

}  // namespace ddprpc::rpc::transport
