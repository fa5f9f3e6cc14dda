// Where a job meets: torch.distributed's init_method, read once for RPC and
// for process groups alike.
//
//   "tcp://host:port"  the store is hosted (by rank 0) at host:port;
//   "env://" or ""     MASTER_ADDR and MASTER_PORT, or a Slurm task's
//                      variables (launch_env.h).
//
// "localhost" is taken as 127.0.0.1. A malformed or incomplete init_method
// throws std::invalid_argument saying what is missing.
#pragma once

#include <string>

namespace ddprpc::rpc {

struct StoreAddress {
  std::string host;
  int port = 0;
};

StoreAddress parse_init_method(const std::string& init_method);

// True for an address that does not leave this host (127.0.0.0/8, ::1,
// localhost): a server there is reachable only from the host itself.
bool loopback_address(const std::string& host);

// This process's rank and world size: `rank` and `world_size` when they are
// not negative, else the launcher's (launch_env.h). Throws
// std::invalid_argument when neither gives one, or the rank is out of range.
struct RankAndSize {
  int rank = -1;
  int world_size = -1;
};
RankAndSize rank_and_size(int rank, int world_size);

}  // namespace ddprpc::rpc
