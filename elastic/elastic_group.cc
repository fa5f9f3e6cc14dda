#include "elastic/elastic_group.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "rpc/agent.h"
#include "rpc/rpc.h"

namespace ddprpc::elastic {
namespace {

// The agent's ping, registered by every agent.
constexpr char kPing[] = "__rpc.ping";

}  // namespace

ElasticGroup::ElasticGroup(std::shared_ptr<rpc::Store> store,
                           std::shared_ptr<MembershipWatch> watch, std::string self,
                           Options options)
    : store_(std::move(store)),
      watch_(std::move(watch)),
      self_(std::move(self)),
      options_(std::move(options)) {}

absl::Status ElasticGroup::form(const rpc::Membership& m) {
  std::vector<std::string> members;
  for (const std::string& w : m.members) {
    if (absl::StartsWith(w, options_.role)) members.push_back(w);
  }
  auto me = std::find(members.begin(), members.end(), self_);
  if (me == members.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", self_, "' is not among the ", options_.role, " members of epoch ",
                     m.epoch, " (", absl::StrJoin(members, ","), ")"));
  }
  const int rank = static_cast<int>(me - members.begin());
  group_.reset();  // the old group's connections go first
  try {
    group_ = ddp::make_gloo_group(store_, absl::StrCat(options_.prefix, "epoch", m.epoch, "/"), rank,
                                  static_cast<int>(members.size()), options_.group);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("forming the group of epoch ", m.epoch, " (",
                                               members.size(), " members): ", e.what()));
  }
  epoch_ = m.epoch;
  members_ = std::move(members);
  return absl::OkStatus();
}

void ElasticGroup::log_change(int64_t from) const {
  LOG(WARNING) << "elastic group of '" << self_ << "': epoch " << from << " -> " << epoch_ << ", "
               << members_.size() << " members (" << absl::StrJoin(members_, ",") << ")";
}

int ElasticGroup::rank() const {
  return static_cast<int>(std::find(members_.begin(), members_.end(), self_) - members_.begin());
}

std::shared_ptr<ddp::ProcessGroup> ElasticGroup::group() {
  if (group_ == nullptr) {
    absl::StatusOr<rpc::Membership> m = watch_->current();
    absl::Status ok = m.ok() ? form(*m) : m.status();
    if (!ok.ok()) throw std::runtime_error(absl::StrCat("elastic group of '", self_, "': ", ok.message()));
  }
  return group_;
}

absl::StatusOr<int64_t> ElasticGroup::advance(int64_t epoch) {
  if (epoch == epoch_ && group_ != nullptr) return epoch_;
  if (epoch < epoch_) {
    return absl::InvalidArgumentError(absl::StrCat("elastic group of '", self_, "' is at epoch ",
                                                   epoch_, ", past epoch ", epoch));
  }
  group_.reset();
  absl::StatusOr<rpc::Membership> m = watch_->at_epoch(epoch);
  if (!m.ok()) return m.status();
  const int64_t from = epoch_;
  if (absl::Status ok = form(*m); !ok.ok()) return ok;
  log_change(from);
  return epoch_;
}

absl::StatusOr<int64_t> ElasticGroup::recover(std::vector<at::Tensor> state) {
  const int64_t from = epoch_;
  // The old group goes first (the caller's holds on it too): a survivor
  // still waiting in one of its collectives fails at once, not at its
  // timeout, and comes to recover as well.
  group_.reset();
  std::shared_ptr<rpc::RpcAgent> agent = rpc::current_agent();
  if (agent == nullptr) return absl::FailedPreconditionError("recover() needs RPC (init_rpc)");
  const absl::Time deadline = absl::Now() + options_.change_timeout;
  std::vector<std::string> lost;
  for (;;) {
    // The group to be: the role's members of the newest epoch, or the old
    // group's while the membership has not moved on. Each is pinged first:
    // a dead one fails at once (the agent's hook then reports it), a
    // stopped or cut-off one by the ping's timeout; a member lost with
    // another but not yet found (a host cut off) is found here, before a
    // group is formed with it.
    absl::StatusOr<rpc::Membership> now = watch_->current();
    const bool moved_on = now.ok() && now->epoch > from;
    std::vector<std::string> candidates = members_;
    if (moved_on) {
      candidates.clear();
      for (const std::string& w : now->members) {
        if (absl::StartsWith(w, options_.role)) candidates.push_back(w);
      }
    }
    std::vector<std::pair<std::string, rpc::Future<c10::IValue>>> pings;
    for (const std::string& w : candidates) {
      if (w == self_) continue;
      for (const rpc::WorkerInfo& info : agent->workers()) {
        if (info.name == w) {
          pings.emplace_back(w, agent->call(info.id, kPing, {}, options_.ping_timeout, "ping"));
        }
      }
    }
    bool silent = false;
    for (auto& [name, ping] : pings) {
      ping.wait_for(options_.ping_timeout + absl::Seconds(1));
      if (!ping.completed() || ping.has_error()) {
        silent = true;
        if (std::find(lost.begin(), lost.end(), name) == lost.end()) lost.push_back(name);
        watch_->report_lost(name);
      }
    }
    if (moved_on && !silent) {
      absl::Status ok = form(*now);
      if (ok.ok()) break;
      if (ok.code() == absl::StatusCode::kFailedPrecondition) return ok;  // not a member
      // A member that answered could not be met (it failed since, or
      // another survivor forms a later epoch): wait for the next change.
      if (absl::Now() >= deadline) return ok;
    }
    // Some survivor removes each lost member; the next epoch says which.
    const int64_t seen = now.ok() ? std::max(now->epoch, from) : from;
    absl::StatusOr<rpc::Membership> next =
        watch_->await_change(seen, std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!next.ok()) {
      return absl::Status(next.status().code(),
                          absl::StrCat("elastic group of '", self_, "' at epoch ", from, " (",
                                       lost.empty() ? std::string("every member answered")
                                                    : absl::StrCat("lost ", absl::StrJoin(lost, ",")),
                                       "): ", next.status().message()));
    }
  }
  log_change(from);
  if (!state.empty()) {
    try {
      group_->broadcast(std::move(state), 0)->wait(options_.group.timeout);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("broadcasting the state in epoch ", epoch_, ": ",
                                                 e.what()));
    }
  }
  return epoch_;
}

}  // namespace ddprpc::elastic
