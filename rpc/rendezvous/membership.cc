#include "rpc/rendezvous/membership.h"

#include <algorithm>
#include <exception>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "rpc/core/errors.h"
#include "rpc/rendezvous/store.h"

namespace ddprpc::rpc {
namespace {

bool contains(const std::vector<std::string>& sorted, absl::string_view name) {
  return std::binary_search(sorted.begin(), sorted.end(), name,
                            [](absl::string_view a, absl::string_view b) { return a < b; });
}

// Sorted names from "a,b,c" ("" for none), each valid, none repeated.
absl::Status decode_names(absl::string_view field, absl::string_view what, size_t* budget,
                          std::vector<std::string>* out) {
  if (field.empty()) return absl::OkStatus();
  for (absl::string_view name : absl::StrSplit(field, ',')) {
    if (*budget == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("more than ", Membership::kMaxWorkers, " workers"));
    }
    --*budget;
    if (!valid_member_name(name)) {
      return absl::InvalidArgumentError(absl::StrCat("a ", what, " name of ", name.size(),
                                                     " bytes that is not [A-Za-z0-9_.:-]{1,",
                                                     Membership::kMaxNameBytes, "}"));
    }
    if (!out->empty() && !(out->back() < name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " names out of order or repeated at '", name, "'"));
    }
    out->emplace_back(name);
  }
  return absl::OkStatus();
}

void insert_sorted(std::vector<std::string>* names, const std::string& name) {
  names->insert(std::lower_bound(names->begin(), names->end(), name), name);
}

void erase(std::vector<std::string>* names, const std::string& name) {
  names->erase(std::remove(names->begin(), names->end(), name), names->end());
}

class StoreAdapter final : public MembershipStore {
 public:
  explicit StoreAdapter(Store* store) : store_(store) {}

  absl::StatusOr<std::string> read(const std::string& key) override {
    return guarded([&] { return store_->check({key}) ? store_->get(key) : std::string(); });
  }
  absl::StatusOr<std::string> compare_set(const std::string& key, const std::string& expected,
                                          const std::string& desired) override {
    return guarded([&] { return store_->compare_set(key, expected, desired); });
  }
  absl::Status wait(const std::string& key, absl::Duration timeout) override {
    absl::StatusOr<std::string> done = guarded([&] {
      store_->wait({key}, timeout);
      return std::string();
    });
    return done.status();
  }

 private:
  template <typename F>
  static absl::StatusOr<std::string> guarded(F f) {
    try {
      return f();
    } catch (const RpcError& e) {
      return absl::Status(e.code() == ErrorCode::kTimeout ? absl::StatusCode::kDeadlineExceeded
                                                           : absl::StatusCode::kUnavailable,
                          e.what());
    } catch (const std::exception& e) {
      return absl::UnavailableError(e.what());
    }
  }

  Store* const store_;
};

}  // namespace

bool valid_member_name(absl::string_view name) {
  if (name.empty() || name.size() > Membership::kMaxNameBytes) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

bool Membership::is_member(absl::string_view worker) const { return contains(members, worker); }

bool Membership::is_joining(absl::string_view worker) const { return contains(joining, worker); }

std::string Membership::encode() const {
  return absl::StrCat(epoch, "|", absl::StrJoin(members, ","), "|", absl::StrJoin(joining, ","));
}

absl::StatusOr<Membership> Membership::decode(absl::string_view record) {
  // The longest record encode() writes for kMaxWorkers names.
  constexpr size_t kMaxRecordBytes = 24 + kMaxWorkers * (kMaxNameBytes + 1);
  if (record.size() > kMaxRecordBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a record of ", record.size(), " bytes"));
  }
  std::vector<absl::string_view> fields = absl::StrSplit(record, '|');
  if (fields.size() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("a record of ", fields.size(), " fields (epoch|members|joining)"));
  }
  Membership m;
  if (fields[0].empty() || fields[0].size() > 18 || fields[0][0] == '0' ||
      !std::all_of(fields[0].begin(), fields[0].end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      !absl::SimpleAtoi(fields[0], &m.epoch)) {
    return absl::InvalidArgumentError("an epoch that is not a positive number");
  }
  size_t budget = kMaxWorkers;
  absl::Status ok = decode_names(fields[1], "member", &budget, &m.members);
  if (ok.ok()) ok = decode_names(fields[2], "joining", &budget, &m.joining);
  if (!ok.ok()) return ok;
  for (const std::string& j : m.joining) {
    if (m.is_member(j)) {
      return absl::InvalidArgumentError(absl::StrCat("'", j, "' both member and joining"));
    }
  }
  return m;
}

std::unique_ptr<MembershipStore> membership_store(Store* store) {
  return std::make_unique<StoreAdapter>(store);
}

MembershipClient::MembershipClient(std::unique_ptr<MembershipStore> store, Options options)
    : store_(std::move(store)), options_(std::move(options)) {}

std::string MembershipClient::epoch_key(int64_t epoch) const {
  return absl::StrCat(options_.key, "/epoch/", epoch);
}

void MembershipClient::announce(const Membership& m) {
  if (m.epoch > 0) (void)store_->compare_set(epoch_key(m.epoch), "", m.encode());
}

absl::StatusOr<Membership> MembershipClient::current() {
  absl::StatusOr<std::string> record = store_->read(options_.key);
  if (!record.ok()) {
    return absl::Status(record.status().code(),
                        absl::StrCat("reading membership '", options_.key,
                                     "': ", record.status().message()));
  }
  if (record->empty()) return Membership();
  absl::StatusOr<Membership> m = Membership::decode(*record);
  if (!m.ok()) {
    return absl::DataLossError(absl::StrCat("membership '", options_.key,
                                            "' holds a record it cannot read: ",
                                            m.status().message()));
  }
  return m;
}

template <typename Change>
absl::StatusOr<Membership> MembershipClient::update(absl::string_view what, Change change) {
  absl::Status last = absl::UnavailableError("no attempt");
  int calls = 0;
  while (calls < options_.max_attempts) {
    ++calls;
    absl::StatusOr<Membership> now = current();
    if (!now.ok()) {
      if (now.status().code() == absl::StatusCode::kDataLoss) return now.status();
      last = now.status();
      continue;
    }
    absl::StatusOr<std::optional<Membership>> next = change(*now);
    if (!next.ok()) return next.status();
    if (!next->has_value()) {
      announce(*now);  // in case its writer was lost before announcing it
      return now;
    }
    // The record this change replaces is kept first, in case its writer
    // was lost before keeping it: at_epoch() can then always read it.
    announce(*now);
    Membership& want = **next;
    want.epoch = now->epoch + 1;
    const std::string expected = now->epoch == 0 ? std::string() : now->encode();
    const std::string desired = want.encode();
    if (calls >= options_.max_attempts) break;
    ++calls;
    absl::StatusOr<std::string> stored = store_->compare_set(options_.key, expected, desired);
    if (stored.ok() && *stored == desired) {
      announce(want);
      return want;
    }
    // Another change came first, or the answer was lost (the change may
    // have taken): the next read tells.
    if (!stored.ok()) last = stored.status();
  }
  return absl::Status(last.code(), absl::StrCat("membership '", options_.key, "': ", what,
                                                " did not take within ", options_.max_attempts,
                                                " store calls: ", last.message()));
}

absl::StatusOr<Membership> MembershipClient::start(std::vector<std::string> members) {
  std::sort(members.begin(), members.end());
  for (size_t i = 0; i < members.size(); ++i) {
    if (!valid_member_name(members[i]) || (i > 0 && members[i] == members[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("start: worker name '", members[i], "' is invalid or repeated"));
    }
  }
  if (members.empty() || members.size() > Membership::kMaxWorkers) {
    return absl::InvalidArgumentError(absl::StrCat("start: ", members.size(), " workers"));
  }
  return update("start", [&](const Membership& now) -> absl::StatusOr<std::optional<Membership>> {
    if (now.epoch > 0) return std::nullopt;
    Membership m;
    m.members = members;
    return std::optional<Membership>(std::move(m));
  });
}

absl::StatusOr<Membership> MembershipClient::remove(const std::string& worker) {
  return update(absl::StrCat("removing '", worker, "'"),
                [&](const Membership& now) -> absl::StatusOr<std::optional<Membership>> {
                  if (!now.is_member(worker) && !now.is_joining(worker)) return std::nullopt;
                  Membership m = now;
                  erase(&m.members, worker);
                  erase(&m.joining, worker);
                  return std::optional<Membership>(std::move(m));
                });
}

absl::StatusOr<Membership> MembershipClient::request_join(const std::string& worker) {
  if (!valid_member_name(worker)) {
    return absl::InvalidArgumentError(absl::StrCat("join: worker name '", worker, "' is invalid"));
  }
  return update(absl::StrCat("joining '", worker, "'"),
                [&](const Membership& now) -> absl::StatusOr<std::optional<Membership>> {
                  if (now.epoch == 0) {
                    return absl::FailedPreconditionError(absl::StrCat(
                        "membership '", options_.key, "': '", worker,
                        "' cannot join a job that has not started"));
                  }
                  if (now.is_member(worker) || now.is_joining(worker)) return std::nullopt;
                  if (now.members.size() + now.joining.size() >= Membership::kMaxWorkers) {
                    return absl::ResourceExhaustedError(absl::StrCat(
                        "membership '", options_.key, "': '", worker, "' cannot join: ",
                        Membership::kMaxWorkers, " workers already"));
                  }
                  Membership m = now;
                  insert_sorted(&m.joining, worker);
                  return std::optional<Membership>(std::move(m));
                });
}

absl::StatusOr<Membership> MembershipClient::admit_joining() {
  return update("admitting the joiners",
                [&](const Membership& now) -> absl::StatusOr<std::optional<Membership>> {
                  if (now.joining.empty()) return std::nullopt;
                  Membership m = now;
                  for (const std::string& j : m.joining) insert_sorted(&m.members, j);
                  m.joining.clear();
                  return std::optional<Membership>(std::move(m));
                });
}

absl::StatusOr<Membership> MembershipClient::at_epoch(int64_t epoch) {
  if (epoch <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("membership '", options_.key, "': epoch ",
                                                   epoch, " does not exist"));
  }
  absl::StatusOr<std::string> kept = store_->read(epoch_key(epoch));
  if (!kept.ok()) {
    return absl::Status(kept.status().code(),
                        absl::StrCat("reading epoch ", epoch, " of membership '", options_.key,
                                     "': ", kept.status().message()));
  }
  if (kept->empty()) {
    // Not kept yet: the record now, if it is of that epoch.
    absl::StatusOr<Membership> now = current();
    if (!now.ok()) return now.status();
    if (now->epoch == epoch) {
      announce(*now);
      return now;
    }
    return absl::NotFoundError(absl::StrCat("membership '", options_.key, "' has no record of epoch ",
                                            epoch, " (it is at epoch ", now->epoch, ")"));
  }
  absl::StatusOr<Membership> m = Membership::decode(*kept);
  if (!m.ok() || m->epoch != epoch) {
    return absl::DataLossError(absl::StrCat(
        "membership '", options_.key, "' keeps a record for epoch ", epoch, " that is not one: ",
        m.ok() ? absl::StrCat("it is of epoch ", m->epoch) : std::string(m.status().message())));
  }
  return m;
}

absl::StatusOr<Membership> MembershipClient::await_change(int64_t epoch, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last = absl::OkStatus();
  for (;;) {
    absl::StatusOr<Membership> now = current();
    if (now.ok() && now->epoch > epoch) return now;
    if (!now.ok()) last = now.status();
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    // The next epoch's key, in slices: a writer lost between its
    // compare_set and its announcement leaves the key unset, and the read
    // above then finds the epoch.
    absl::Status waited = store_->wait(epoch_key(epoch + 1), std::min(left, absl::Seconds(1)));
    if (!waited.ok() && waited.code() != absl::StatusCode::kDeadlineExceeded) {
      last = waited;
      absl::SleepFor(std::min(deadline - absl::Now(), absl::Milliseconds(50)));
    }
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "membership '", options_.key, "' stayed at epoch ", epoch, " for ",
      absl::FormatDuration(timeout), last.ok() ? "" : absl::StrCat(" (", last.message(), ")")));
}

}  // namespace ddprpc::rpc
