// Hosts for a benchmark's ranks on one machine: network namespaces on one
// bridge, each with an address of its own, as hosts on one switch. Ranks
// placed in different namespaces reach each other only over TCP/IP (veth
// pairs through the bridge, MTU 1500): not through loopback, and not
// through the same-host paths of either ddprpc or PyTorch, which each see
// another host. What the kernel spends on the veth pairs is spent by this
// machine's CPUs, as a NIC's driver would.
//
// The namespaces are made by this process (root: `ip netns`) and removed
// when the NetworkHosts is destroyed; those of a run that was killed are
// removed by the next one to start.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "benchmarks/harness.h"

namespace ddprpc::benchmarks {

class NetworkHosts {
 public:
  // `count` (1..9) hosts; null, with *error saying why, when they cannot be
  // made (not root, no `ip`).
  static std::unique_ptr<NetworkHosts> create(int count, std::string* error);
  ~NetworkHosts();
  NetworkHosts(const NetworkHosts&) = delete;
  NetworkHosts& operator=(const NetworkHosts&) = delete;

  int size() const { return static_cast<int>(namespaces_.size()); }
  // The names `ip netns` knows them by (rpc::LaunchOptions::network_namespaces).
  const std::vector<std::string>& namespaces() const { return namespaces_; }
  // The IPv4 address of host `i` (0-based).
  std::string address(int i) const;
  // E.g. "3 network namespaces on a bridge (veth, MTU 1500): 10.213.0.1-3,
  // rank r on host r % 3".
  std::string describe() const;
  // Places the ranks of `options` on these hosts: rank r on host r %
  // size(), the rendezvous at host 0's address.
  void place(RolesOptions* options) const;

 private:
  NetworkHosts(std::string bridge, std::vector<std::string> namespaces)
      : bridge_(std::move(bridge)), namespaces_(std::move(namespaces)) {}
  void remove();

  const std::string bridge_;
  const std::vector<std::string> namespaces_;
};

// A benchmark's --hosts=`count`: null for 0 (every rank on this host),
// else the hosts; when they cannot be made, says why (naming `benchmark`)
// and exits with code 1.
std::unique_ptr<NetworkHosts> hosts_from_flag(const char* benchmark, int count);

// The local address that routes to `host`: the one peers on other hosts can
// reach this process at (127.0.0.1 when `host` is this one). "" if none.
std::string local_address_towards(const std::string& host);

}  // namespace ddprpc::benchmarks
