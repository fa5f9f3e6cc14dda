#include "rpc/rendezvous/init_method.h"

#include <stdexcept>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "rpc/rendezvous/launch_env.h"

namespace ddprpc::rpc {

StoreAddress parse_init_method(const std::string& init_method) {
  std::string host, port;
  if (init_method.empty() || init_method == "env://") {
    LaunchEnv env;
    try {
      env = launch_env();
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("init_method env://: ") + e.what());
    }
    if (env.master_addr.empty() || env.master_port == 0) {
      throw std::invalid_argument(
          "init_method env:// needs the MASTER_ADDR and MASTER_PORT environment variables, or "
          "a Slurm task's (or pass init_method=\"tcp://host:port\")");
    }
    host = env.master_addr;
    port = std::to_string(env.master_port);
  } else if (absl::StartsWith(init_method, "tcp://")) {
    std::string rest = init_method.substr(6);
    size_t colon = rest.rfind(':');
    if (colon == std::string::npos) {
      throw std::invalid_argument("init_method '" + init_method +
                                  "' has no port (expected tcp://host:port)");
    }
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  } else {
    throw std::invalid_argument("unsupported init_method '" + init_method +
                                "' (use tcp://host:port or env://)");
  }
  int port_number = 0;
  if (!absl::SimpleAtoi(port, &port_number) || port_number <= 0 || port_number > 65535) {
    throw std::invalid_argument("invalid rendezvous port '" + port + "'");
  }
  if (host.empty()) throw std::invalid_argument("init_method '" + init_method + "' has no host");
  if (host == "localhost") host = "127.0.0.1";
  return {host, port_number};
}

bool loopback_address(const std::string& host) {
  return absl::StartsWith(host, "127.") || host == "::1" || host == "[::1]" || host == "localhost";
}

RankAndSize rank_and_size(int rank, int world_size) {
  if (rank < 0 || world_size < 0) {
    const LaunchEnv env = launch_env();
    if (rank < 0) rank = env.rank;
    if (world_size < 0) world_size = env.world_size;
  }
  if (rank < 0 || world_size < 0) {
    throw std::invalid_argument(
        "no rank or world size: pass them, or start the process with RANK and WORLD_SIZE "
        "(rpc::launch, torchrun) or as a Slurm task");
  }
  if (world_size < 1 || rank >= world_size) {
    throw std::invalid_argument(absl::StrCat("invalid rank ", rank, " for world size ", world_size));
  }
  return {rank, world_size};
}

}  // namespace ddprpc::rpc
