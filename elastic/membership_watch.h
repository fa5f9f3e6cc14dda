// Keeps the job's membership (rpc/rendezvous/membership.h) in step with the
// workers this process finds gone.
//
// A worker whose connection fails (reset, refused, or silent past the
// keepalive timeout) is removed from the membership by the first survivor
// that finds it; every other survivor learns of it from the store, through
// await_change(), whether or not it talked to that worker. The removal
// runs on a thread of the watch, never on the RPC thread that found it.
//
//   rpc::init_rpc(...);
//   auto watch = elastic::MembershipWatch::start(store, {"trainer0", ...});
//   ...
//   absl::StatusOr<rpc::Membership> next = watch->await_change(epoch, timeout);
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rpc/rendezvous/membership.h"

namespace ddprpc::rpc {
class Store;
}  // namespace ddprpc::rpc

namespace ddprpc::elastic {

class MembershipWatch {
 public:
  // Starts (or finds) the membership with `members` in `store`, and
  // installs an RPC hook (rpc/hooks.h) that hands each worker this process
  // finds unreachable to the watch's thread, which removes it. Hooks stay
  // for the process; once the watch is destroyed its hook does nothing.
  // Destruction waits for a removal in progress, which is bounded by
  // `options.max_attempts` store calls.
  static absl::StatusOr<std::shared_ptr<MembershipWatch>> start(
      std::shared_ptr<rpc::Store> store, std::vector<std::string> members,
      rpc::MembershipClient::Options options = {});
  ~MembershipWatch();

  MembershipWatch(const MembershipWatch&) = delete;
  MembershipWatch& operator=(const MembershipWatch&) = delete;

  // The membership now, as the store holds it. Thread-safe, as are the
  // others.
  absl::StatusOr<rpc::Membership> current();
  // Blocks until the membership's epoch is past `epoch`, at most `timeout`.
  absl::StatusOr<rpc::Membership> await_change(int64_t epoch, absl::Duration timeout);
  // The membership of epoch `epoch`, as that epoch held it; see
  // rpc::MembershipClient::at_epoch.
  absl::StatusOr<rpc::Membership> at_epoch(int64_t epoch);
  // Takes `worker` out of the membership now, on this thread (a joiner that
  // cannot take part after all, taking itself out so that the others go
  // on without it).
  absl::StatusOr<rpc::Membership> remove(const std::string& worker);
  // Queues `worker` for removal, as when this process finds it unreachable
  // (for a worker found gone some other way: a collective that failed on
  // it, calls that time out).
  void report_lost(const std::string& worker);
  // `worker` (a replacement: in the RPC world, not yet a member) asks to
  // join; see rpc::MembershipClient::request_join.
  absl::StatusOr<rpc::Membership> request_join(const std::string& worker);
  // The joiners become members (at an iteration boundary); see
  // rpc::MembershipClient::admit_joining.
  absl::StatusOr<rpc::Membership> admit_joining();
  // Workers this watch removed or failed to remove (the error), in order.
  std::vector<std::string> removals();

  class State;

 private:
  explicit MembershipWatch(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace ddprpc::elastic
