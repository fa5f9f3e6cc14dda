// The server side of the same-host transport: a listening socket in the
// abstract namespace, its acceptor (handshakes and the job's proof), and
// the connections' reading role, watchdog and threads (see
// same_host_listener.cc).
#pragma once

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "rpc/core/security.h"
#include "rpc/transport/internal/same_host_connection.h"
#include "rpc/transport/transport.h"

namespace ddprpc::rpc::transport::same_host {

class Listener {
 public:
  virtual ~Listener() = default;
  // The socket's name in the abstract namespace (the endpoint's second part).
  virtual const std::string& name() const = 0;
  // Stops accepting, gives open connections `grace` to answer what they
  // have read, then ends them and joins every thread. Called before the
  // last reference goes.
  virtual void shutdown(absl::Duration grace) = 0;
};

// Listens with `limits` and `security`; requests go through `check`, then
// to `run_inline` on the reading thread or to `offload` (Transport::listen).
// Null if no socket can be made (peers on this host then use the fallback).
std::shared_ptr<Listener> start_listener(const ServerLimits& limits, const Security& security,
                                         Transport::CheckRequest check,
                                         Transport::OnRequest run_inline,
                                         Transport::OnRequest offload,
                                         std::shared_ptr<const Settings> settings);

}  // namespace ddprpc::rpc::transport::same_host
