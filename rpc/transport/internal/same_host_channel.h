// The caller's side of a same-host connection: a Channel whose replies are
// read by the holder of its reading role (a waiting caller, see
// same_host_read_gate.h, or the channel's background thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "rpc/transport/internal/same_host_connection.h"
#include "rpc/transport/internal/same_host_read_gate.h"
#include "rpc/transport/transport.h"

namespace ddprpc::rpc::transport::same_host {

class SameHostChannel : public Channel,
                        public DrivenChannel,
                        public std::enable_shared_from_this<SameHostChannel> {
 public:
  // Null if the server's socket cannot be reached.
  static std::shared_ptr<SameHostChannel> open(const std::shared_ptr<ReadGate>& gate,
                                               const std::string& name,
                                               const PeerOptions& options, OnFrame on_frame,
                                               OnClose on_close);

  ~SameHostChannel() override = default;

  bool send(Frame frame, const SendOptions& options) override;

  bool broken() const override {
    absl::MutexLock lock(&gate_->mu);
    return ended_;
  }
  void drive(const std::function<bool()>& done, absl::Time deadline) override {
    drive_same_host(gate_, done, deadline);
  }

  // Reads what has come (a goodbye, the end of the connection) and looks at
  // the peer's process when no thread reads: an idle channel learns of its
  // peer's end, or that it has stopped, here.
  void check_connection() override;

  void close(bool graceful) override;
  // A later close(true) lets this channel's queued writes out until 5 s
  // after this call, not 5 s after its own (begun more than 5 s before,
  // they get one attempt). Sends fail from now on.
  void begin_close() override;

  // ---- DrivenChannel, for drive_same_host

  bool claim_for_driver(std::thread::id me, bool* nested) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu);
  void release_for_driver() override ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) {
    holder_ = std::thread::id();
    ++gate_->version;
  }
  bool over() const override ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) {
    return ended_ || closing_;
  }
  bool held_by_other(std::thread::id me) const override ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) {
    return !ended_ && ((holder_ != std::thread::id() && holder_ != me) || !welcomed_);
  }
  Conn* conn() override { return conn_.get(); }
  void read_one_or_end() override {
    absl::Status ok = read_one();
    if (!ok.ok()) end(failed(ok));
  }
  void check_peer_or_end() override {
    absl::Status ok = conn_->check_peer_now_and_then();
    if (!ok.ok()) end(failed(ok));
  }

 private:
  SameHostChannel(std::shared_ptr<ReadGate> gate, std::unique_ptr<Conn> conn, OnFrame on_frame,
                  OnClose on_close)
      : gate_(std::move(gate)),
        conn_(std::move(conn)),
        on_frame_(std::move(on_frame)),
        on_close_(std::move(on_close)) {}

  static CloseReason failed(const absl::Status& why);

  bool try_take_role();
  void release_role() {
    absl::MutexLock lock(&gate_->mu);
    holder_ = std::thread::id();
    ++gate_->version;
  }

  // Ends the channel once: the socket closes and OnClose runs.
  void end(const CloseReason& reason);
  bool closing_now() {
    absl::MutexLock lock(&gate_->mu);
    return closing_;
  }

  // Reads while replies are expected and nobody else reads.
  void background_loop();

  // One message: a reply, an acknowledgement or a goodbye. Never throws.
  absl::Status read_one();
  absl::Status read_one_unguarded();

  absl::Status welcome();

  const std::shared_ptr<ReadGate> gate_;
  const std::unique_ptr<Conn> conn_;
  const OnFrame on_frame_;
  const OnClose on_close_;

  // State below is protected by gate_->mu.
  bool ended_ ABSL_GUARDED_BY(gate_->mu) = false;
  bool closing_ ABSL_GUARDED_BY(gate_->mu) = false;
  bool close_done_ ABSL_GUARDED_BY(gate_->mu) = false;
  absl::Time close_by_ ABSL_GUARDED_BY(gate_->mu) = absl::InfiniteFuture();  // begin_close()
  bool welcomed_ ABSL_GUARDED_BY(gate_->mu) = false;  // the handshake is over
  bool background_done_ ABSL_GUARDED_BY(gate_->mu) = false;
  int64_t expecting_ ABSL_GUARDED_BY(gate_->mu) = 0;  // replies not yet read
  std::thread::id holder_ ABSL_GUARDED_BY(gate_->mu);  // of the reading role
  std::thread::id background_id_ ABSL_GUARDED_BY(gate_->mu);
};

}  // namespace ddprpc::rpc::transport::same_host
