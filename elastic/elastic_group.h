// A process group (DDP's allreduce) over the members of the job's current
// membership epoch, formed again when the epoch changes.
//
// The group of epoch e holds the members whose names start with
// `Options::role`, ranked by name, and meets in the store under
// "<prefix>epoch<e>/". When one of its collectives fails (a member died,
// stopped or was cut off), every survivor calls recover(): it pings the
// group's members over RPC and reports those that do not answer to the
// membership watch, waits for the next epoch, pings that epoch's members
// the same way (a member lost with another, not yet found, is found before
// a group is formed with it), forms that epoch's group and
// broadcasts `state` (the replica's dense parameters, say) from its rank 0,
// so that every survivor goes on from the same values whether or not its
// own step completed. The step in flight is then dropped everywhere: run
// it again, or go on with the next one.
//
//   ElasticGroup trainers(store, watch, "trainer1", options);
//   for (...) {
//     try {
//       trainers.group()->allreduce({grad})->wait(timeout);
//     } catch (const std::exception&) {
//       trainers.recover(parameters).value();   // throws if it cannot
//       continue;                               // the step is dropped
//     }
//     ...
//   }
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ddp/process_group.h"
#include "elastic/membership_watch.h"

namespace ddprpc::rpc {
class Store;
}  // namespace ddprpc::rpc

namespace ddprpc::elastic {

class ElasticGroup {
 public:
  struct Options {
    // Members of the group: those whose names start with this.
    std::string role = "trainer";
    // Store keys of the groups: "<prefix>epoch<e>/...".
    std::string prefix = "ddprpc/elastic/";
    ddp::ProcessGroupOptions group;
    // How long a member that does not answer a ping is given.
    absl::Duration ping_timeout = absl::Seconds(5);
    // How long recover() waits for the membership to change.
    absl::Duration change_timeout = absl::Seconds(60);
  };

  // `self` must be a member of the group's role in the current epoch.
  ElasticGroup(std::shared_ptr<rpc::Store> store, std::shared_ptr<MembershipWatch> watch,
               std::string self, Options options);

  // The group of the epoch this process is in, formed on first use
  // (a collective: every member calls it). Throws std::runtime_error when
  // the membership cannot be read or `self` is not in it.
  std::shared_ptr<ddp::ProcessGroup> group();
  int64_t epoch() const { return epoch_; }
  // This member's rank in group(), and the group's members, ranked.
  int rank() const;
  const std::vector<std::string>& members() const { return members_; }

  // After a collective of group() failed: see above. Callers drop their
  // own references to the old group first. Returns the new epoch,
  // or an error when the membership did not change within change_timeout
  // (every member answered this one's pings and no other worker found one
  // gone: the failure was something else). Every tensor of `state` is
  // overwritten by rank 0's of the new group.
  absl::StatusOr<int64_t> recover(std::vector<at::Tensor> state);

  // When the membership has grown (joiners admitted in epoch `epoch`):
  // every member of that epoch, the joiners included, calls it with the
  // same `epoch` at the same point (a collective); the group of the members
  // that epoch held is formed, the old one dropped first. The members agree
  // on `epoch` beforehand (the largest epoch any of them saw, by an
  // allreduce in the old group): each reading the membership on its own
  // could see a later epoch than another, and the two would wait in groups
  // of their own. A member lost since `epoch` makes the forming or the
  // group's first collective fail, and recover() goes on from there.
  // Returns `epoch`; InvalidArgument for an epoch before this group's.
  absl::StatusOr<int64_t> advance(int64_t epoch);

 private:
  // Forms the group of membership `m`.
  absl::Status form(const rpc::Membership& m);
  // Logs the move from epoch `from` to the group formed now.
  void log_change(int64_t from) const;

  const std::shared_ptr<rpc::Store> store_;
  const std::shared_ptr<MembershipWatch> watch_;
  const std::string self_;
  const Options options_;
  int64_t epoch_ = 0;
  std::vector<std::string> members_;  // of the group, ranked
  std::shared_ptr<ddp::ProcessGroup> group_;
};

}  // namespace ddprpc::elastic
