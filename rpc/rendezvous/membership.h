// A job's membership that can change: an epoch number, the workers of that
// epoch, and the workers waiting to be admitted.
//
// The record lives under one key of the rendezvous store and changes only
// by compare_set from the record a caller read, to one with the next epoch.
// Epochs therefore never repeat, every change is one step from the epoch
// before, and every worker that reads the key sees the same sequence.
//
// A store call whose answer is lost may still have taken effect. Every
// operation here therefore reads the record again before each attempt and
// stops as soon as the record already shows what it asked for: removing a
// worker that is gone, adding one that is there, and admitting joiners that
// are members all end at once. Removals by several survivors of the same
// lost worker make one epoch, not several.
//
//   MembershipClient members(membership_store(&store));
//   members.start({"trainer0", "trainer1", "ps0"});      // epoch 1, once
//   members.remove("trainer1");                           // a survivor
//   members.request_join("trainer1b");                    // a replacement
//   members.admit_joining();                              // at a boundary
//   members.await_change(seen_epoch, absl::Seconds(20));  // every survivor
//   members.at_epoch(agreed_epoch);                       // what it held
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace ddprpc::rpc {

class Store;

struct Membership {
  // Bounds of a record read from the store, which any member can write.
  static constexpr size_t kMaxWorkers = 4096;
  static constexpr size_t kMaxNameBytes = 128;

  int64_t epoch = 0;  // 0: no record yet
  std::vector<std::string> members;  // sorted, no duplicates
  std::vector<std::string> joining;  // sorted, none of them a member

  bool is_member(absl::string_view worker) const;
  bool is_joining(absl::string_view worker) const;

  // "epoch|m1,m2,...|j1,j2,...". Names are 1..kMaxNameBytes of
  // [A-Za-z0-9_.:-].
  std::string encode() const;
  // Refuses (InvalidArgument, saying what is wrong) anything encode() would
  // not write: a bad epoch, names or separators, unsorted or repeated names,
  // a joiner that is a member, more than kMaxWorkers names in all.
  static absl::StatusOr<Membership> decode(absl::string_view record);
};

// Whether `name` can be a worker of a membership record.
bool valid_member_name(absl::string_view name);

// The two store operations membership needs. Errors are statuses; a call
// that fails may or may not have taken effect.
class MembershipStore {
 public:
  virtual ~MembershipStore() = default;
  // The value at `key`, or "" when it is unset. Does not block.
  virtual absl::StatusOr<std::string> read(const std::string& key) = 0;
  // As Store::compare_set.
  virtual absl::StatusOr<std::string> compare_set(const std::string& key,
                                                  const std::string& expected,
                                                  const std::string& desired) = 0;
  // Blocks until `key` is set or `timeout` passes (DeadlineExceeded).
  virtual absl::Status wait(const std::string& key, absl::Duration timeout) = 0;
};

// `store` (not owned; it must outlive the result) as a MembershipStore.
std::unique_ptr<MembershipStore> membership_store(Store* store);

class MembershipClient {
 public:
  struct Options {
    std::string key = "ddprpc/membership";
    // Store calls per operation (reads and compare_sets together) before it
    // fails with the last error.
    int max_attempts = 64;
  };

  explicit MembershipClient(std::unique_ptr<MembershipStore> store)
      : MembershipClient(std::move(store), Options()) {}
  MembershipClient(std::unique_ptr<MembershipStore> store, Options options);

  // The record now (epoch 0 and no workers when there is none).
  absl::StatusOr<Membership> current();

  // Epoch 1 with `members`, unless a record exists: then that record.
  // Every worker of a job may call it; the first one writes.
  absl::StatusOr<Membership> start(std::vector<std::string> members);

  // The next epoch without `worker` (neither member nor joiner); the record
  // as it is when `worker` is already out.
  absl::StatusOr<Membership> remove(const std::string& worker);

  // `worker` waits to be admitted (the next epoch lists it as joining); the
  // record as it is when it is already a member or joining. Fails
  // (FailedPrecondition) when there is no record yet: start() comes first.
  absl::StatusOr<Membership> request_join(const std::string& worker);

  // The next epoch with every joiner made a member; the record as it is
  // when none is waiting. Call it where the job can take new workers (an
  // iteration boundary).
  absl::StatusOr<Membership> admit_joining();

  // Blocks until the record's epoch is past `epoch`, at most `timeout`
  // (DeadlineExceeded); returns the newer record.
  absl::StatusOr<Membership> await_change(int64_t epoch, absl::Duration timeout);

  // The record of epoch `epoch` as it was written, whatever the epoch is
  // now: every epoch's record is kept under a key of its own, before the
  // next epoch is written. Workers that agreed on an epoch read the same
  // members here. NotFound when that epoch has not come yet, or when its
  // writer was lost before keeping it and the record has moved on; DataLoss
  // when what is kept is not a record of that epoch.
  absl::StatusOr<Membership> at_epoch(int64_t epoch);

 private:
  // Rewrites the record by `change` (nullopt: the record already shows what
  // was asked for) until a compare_set of the next epoch takes, or the
  // record shows it, within max_attempts store calls. `what` names the
  // operation in errors.
  template <typename Change>
  absl::StatusOr<Membership> update(absl::string_view what, Change change);
  // The key set once an epoch exists, which await_change() waits on.
  std::string epoch_key(int64_t epoch) const;
  // Keeps `m` at epoch_key() for at_epoch() and for waiters (idempotent;
  // failure only delays waiters to their next read).
  void announce(const Membership& m);

  const std::unique_ptr<MembershipStore> store_;
  const Options options_;
};

}  // namespace ddprpc::rpc
