// The same-host transport as a pair: each server listens on the wrapped
// transport and on a same-host socket; each channel goes over the socket
// to a peer of this host, over the wrapped transport to any other. The
// parts live in internal/: same_host_process (/proc and sockets),
// same_host_connection (one end of a socket), same_host_listener (the
// server), same_host_channel (the caller's side), same_host_read_gate (who
// reads replies), cross_memory (tensors read from the peer's memory).
#include "rpc/transport/same_host_transport.h"

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "rpc/transport/internal/same_host_channel.h"
#include "rpc/transport/internal/same_host_connection.h"
#include "rpc/transport/internal/same_host_listener.h"
#include "rpc/transport/internal/same_host_process.h"
#include "rpc/transport/internal/same_host_read_gate.h"
#include "rpc/transport/spin_budget.h"

namespace ddprpc::rpc::transport {
namespace {

using same_host::Lend;
using same_host::ReadGate;
using same_host::Settings;
using same_host::drive_same_host;

class PairServer : public Server {
 public:
  PairServer(std::unique_ptr<Server> fallback, std::shared_ptr<same_host::Listener> local)
      : fallback_(std::move(fallback)), local_(std::move(local)) {}
  ~PairServer() override {
    if (local_) local_->shutdown(absl::ZeroDuration());
  }
  int port() const override { return fallback_->port(); }
  std::string same_host_endpoint() const override {
    return local_ ? absl::StrCat(host_identity(), "|", local_->name()) : std::string();
  }
  std::string bulk_endpoint() const override { return fallback_->bulk_endpoint(); }
  void shutdown(absl::Duration grace) override {
    if (local_) local_->shutdown(grace);
    fallback_->shutdown(grace);
  }

 private:
  const std::unique_ptr<Server> fallback_;
  const std::shared_ptr<same_host::Listener> local_;
};

// A channel of the wrapped transport; waits on it lend this thread's
// same-host reservations back (see ReadGate).
class FallbackChannel : public Channel {
 public:
  FallbackChannel(std::shared_ptr<ReadGate> gate, std::shared_ptr<Channel> inner)
      : gate_(std::move(gate)), inner_(std::move(inner)) {}
  bool send(Frame frame, const SendOptions& options) override {
    return inner_->send(std::move(frame), options);
  }
  bool broken() const override { return inner_->broken(); }
  void drive(const std::function<bool()>& done, absl::Time deadline) override {
    Lend lend(gate_.get(), /*same_host_side=*/true);
    inner_->drive(done, deadline);
  }
  void check_connection() override { inner_->check_connection(); }
  void close(bool graceful) override { inner_->close(graceful); }
  void begin_close() override { inner_->begin_close(); }
  Channel* inner() const { return inner_.get(); }

 private:
  const std::shared_ptr<ReadGate> gate_;
  const std::shared_ptr<Channel> inner_;
};

class SameHostTransport : public Transport {
 public:
  SameHostTransport(std::shared_ptr<Transport> fallback, const TransportOptions& options)
      : fallback_(std::move(fallback)),
        settings_(std::make_shared<Settings>(options)),
        gate_(std::make_shared<ReadGate>()) {
    gate_->fallback = fallback_.get();
    gate_->settings = settings_;
  }

  std::unique_ptr<Server> listen(const std::string& host, const ServerLimits& limits,
                                 const Security& security, CheckRequest check,
                                 OnRequest run_inline, OnRequest offload) override {
    std::unique_ptr<Server> fallback =
        fallback_->listen(host, limits, security, check, run_inline, offload);
    return std::make_unique<PairServer>(
        std::move(fallback),
        same_host::start_listener(limits, security, std::move(check), std::move(run_inline),
                                  std::move(offload), settings_));
  }

  std::shared_ptr<Channel> connect(const std::string& address, const PeerOptions& options,
                                   Channel::OnFrame on_frame, Channel::OnClose on_close) override {
    const std::string& endpoint = options.same_host_endpoint;
    const size_t bar = endpoint.rfind('|');
    if (bar != std::string::npos && endpoint.substr(0, bar) == host_identity()) {
      std::shared_ptr<Channel> ch = same_host::SameHostChannel::open(gate_, endpoint.substr(bar + 1),
                                                          options, on_frame, on_close);
      if (ch) return ch;
      LOG(WARNING) << "rpc: cannot reach the same-host endpoint of " << address
                   << "; connecting over the network";
    }
    // Its replies wake same-host readers too: one may wait for what a reply
    // completed.
    Channel::OnFrame wrapped = [gate = gate_, on_frame = std::move(on_frame)](Frame frame) {
      absl::Status ok = on_frame(std::move(frame));
      absl::MutexLock lock(&gate->mu);
      ++gate->version;
      gate->wake_drivers();
      return ok;
    };
    return std::make_shared<FallbackChannel>(
        gate_, fallback_->connect(address, options, std::move(wrapped), std::move(on_close)));
  }

  void reserve_reading() override {
    fallback_->reserve_reading();
    absl::MutexLock lock(&gate_->mu);
    ++gate_->reserved;
    ++gate_->reserved_by[std::this_thread::get_id()];
    gate_->reserved_by_threads.fetch_add(1, std::memory_order_relaxed);
  }
  void release_reading() override {
    fallback_->release_reading();
    absl::MutexLock lock(&gate_->mu);
    --gate_->reserved;
    auto it = gate_->reserved_by.find(std::this_thread::get_id());
    if (it == gate_->reserved_by.end()) return;
    gate_->reserved_by_threads.fetch_sub(1, std::memory_order_relaxed);
    if (--it->second == 0) gate_->reserved_by.erase(it);
  }

  void drive(const std::function<bool()>& done, absl::Time deadline) override {
    drive_same_host(gate_, done, deadline);
  }

  bool probe(const std::string& address, const PeerOptions& options,
             absl::Time deadline) override {
    return fallback_->probe(address, options, deadline);
  }

  // Waits spin before they sleep only while the job's processes on this
  // host fit its CPUs: with more, a spinning thread takes the CPU a peer
  // needs to answer.
  void world_known(const std::vector<std::string>& same_host_endpoints,
                   const std::vector<std::string>& bulk_endpoints) override {
    fallback_->world_known(same_host_endpoints, bulk_endpoints);
    int here = 0;
    for (const std::string& endpoint : same_host_endpoints) {
      const size_t bar = endpoint.rfind('|');
      if (bar != std::string::npos && endpoint.substr(0, bar) == host_identity()) ++here;
    }
    settings_->spin_ns.store(
        here >= 2 && here <= usable_cpus() ? spin_ns(settings_->options.max_spin) : 0,
        std::memory_order_relaxed);
  }

 private:
  const std::shared_ptr<Transport> fallback_;
  const std::shared_ptr<Settings> settings_;
  const std::shared_ptr<ReadGate> gate_;
};

}  // namespace

const std::string& host_identity() {
  static const std::string id = absl::StrCat(
      same_host::read_small_file("/proc/sys/kernel/random/boot_id"), "/",
      same_host::link_target("/proc/self/ns/net"), "/", same_host::link_target("/proc/self/ns/pid"));
  return id;
}

std::shared_ptr<Transport> make_same_host_transport(std::shared_ptr<Transport> fallback,
                                                    const TransportOptions& options) {
  return std::make_shared<SameHostTransport>(std::move(fallback), options);
}

}  // namespace ddprpc::rpc::transport
