// Round trips over plain TCP socket pairs: what the network between two
// ranks moves with no RPC runtime on it, the bound beside rpc_pingpong's
// figures. Each round the caller writes `bytes` and the echo, having read
// all of them, writes them back (as an RPC identity does). With several
// streams the bytes are split evenly between that many connections, each
// written and read by a thread of its own on both ends (as iperf -P does;
// every stream has its thread, at the normal scheduling policy):
// one TCP stream is processed by one CPU at a time in the kernel, several
// spread over the CPUs. TCP_NODELAY on every connection, the kernel's own
// buffer sizes; reads of 64 KiB and more wait for the receive low-water
// mark (rpc/core/internal/receive_low_water.h), as the runtime's bulk
// reads do. With `spin_us`, each read of a message first looks for its
// bytes without sleeping for up to that long, as the runtime's waits do
// under RpcBackendOptions::max_spin.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace ddprpc::benchmarks {

// A listening socket on `address`, port chosen by the kernel.
struct RawTcpListener {
  int fd = -1;
  int port = 0;
};
absl::Status raw_tcp_listen(const std::string& address, RawTcpListener* out);

// Accepts `streams` connections on `listener` (then closes it) and runs
// `warmup` + `rounds` round trips of `bytes`; the microseconds of the last
// `rounds` go to *micros.
absl::Status raw_tcp_round_trips(RawTcpListener listener, int streams, int64_t bytes, int warmup,
                                 int rounds, std::vector<double>* micros, int spin_us = 0);

// The other end: opens `streams` connections to host:port and echoes
// `total_rounds` rounds of `bytes`.
absl::Status raw_tcp_echo(const std::string& host, int port, int streams, int64_t bytes,
                          int total_rounds, int spin_us = 0);

// A ring over plain TCP, the bound beside a ring allreduce's figures: each
// rank streams bytes to the next rank while it reads as many from the one
// before (a thread writes while the caller reads), with none of the
// allreduce's waits between steps and none of its reductions.
struct RawTcpRing {
  int to_next = -1;
  int from_previous = -1;
};

// Connects to the next rank's listener at host:port and accepts the
// previous rank's connection on `listener` (then closes it).
absl::Status raw_tcp_ring_connect(RawTcpListener listener, const std::string& next_host,
                                  int next_port, RawTcpRing* out);

// One round: writes `out` to the next rank and reads as many bytes from
// the previous one into `in`.
absl::Status raw_tcp_ring_round(const RawTcpRing& ring, const std::string& out, std::string* in);

void raw_tcp_ring_close(RawTcpRing* ring);

}  // namespace ddprpc::benchmarks
