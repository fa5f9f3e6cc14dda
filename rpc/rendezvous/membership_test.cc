#include "rpc/rendezvous/membership.h"

#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "rpc/rendezvous/store.h"

namespace ddprpc::rpc {
namespace {

constexpr char kKey[] = "ddprpc/membership";

// An in-memory store shared by LossyStore clients, with the history of every
// value written at kKey.
struct StoreState {
  std::mutex mu;
  std::condition_variable changed;
  std::map<std::string, std::string> data;
  std::vector<std::pair<std::string, std::string>> history;  // (before, after) at kKey
};

// A store whose requests and answers get lost, delayed (so that concurrent
// calls reach it in another order than they were made) and delivered twice.
class LossyStore final : public MembershipStore {
 public:
  struct Faults {
    double drop_request = 0;  // never reaches the store
    double drop_reply = 0;    // takes effect, the answer is lost
    double duplicate = 0;     // a compare_set reaches the store again, later
    int max_delay_us = 0;     // before and after the store sees a call
  };

  LossyStore(std::shared_ptr<StoreState> state, Faults faults, uint64_t seed)
      : state_(std::move(state)), faults_(faults), rng_(seed) {}

  absl::StatusOr<std::string> read(const std::string& key) override {
    delay();
    if (chance(faults_.drop_request)) return absl::UnavailableError("request lost");
    std::string value;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      auto it = state_->data.find(key);
      if (it != state_->data.end()) value = it->second;
    }
    delay();
    if (chance(faults_.drop_reply)) return absl::UnavailableError("reply lost");
    return value;
  }

  absl::StatusOr<std::string> compare_set(const std::string& key, const std::string& expected,
                                          const std::string& desired) override {
    delay();
    if (chance(faults_.drop_request)) return absl::UnavailableError("request lost");
    std::string answer = apply(key, expected, desired);
    if (chance(faults_.duplicate)) {
      delay();
      delay();
      (void)apply(key, expected, desired);
    }
    delay();
    if (chance(faults_.drop_reply)) return absl::UnavailableError("reply lost");
    return answer;
  }

  absl::Status wait(const std::string& key, absl::Duration timeout) override {
    std::unique_lock<std::mutex> lock(state_->mu);
    const bool set = state_->changed.wait_for(lock, absl::ToChronoNanoseconds(timeout), [&] {
      return state_->data.count(key) > 0;
    });
    return set ? absl::OkStatus() : absl::DeadlineExceededError("wait timed out");
  }

 private:
  // As the rendezvous store's compare_set.
  std::string apply(const std::string& key, const std::string& expected,
                    const std::string& desired) {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->data.find(key);
    if (it == state_->data.end() && !expected.empty()) return expected;
    if (it != state_->data.end() && it->second != expected) return it->second;
    if (key == kKey) state_->history.emplace_back(expected, desired);
    state_->data[key] = desired;
    state_->changed.notify_all();
    return desired;
  }

  bool chance(double p) {
    std::lock_guard<std::mutex> lock(rng_mu_);
    return std::uniform_real_distribution<double>(0, 1)(rng_) < p;
  }

  void delay() {
    if (faults_.max_delay_us == 0) return;
    int us;
    {
      std::lock_guard<std::mutex> lock(rng_mu_);
      us = std::uniform_int_distribution<int>(0, faults_.max_delay_us)(rng_);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }

  std::shared_ptr<StoreState> state_;
  const Faults faults_;
  std::mutex rng_mu_;
  std::mt19937_64 rng_;
};

MembershipClient client(std::shared_ptr<StoreState> state, LossyStore::Faults faults = {},
                        uint64_t seed = 1, int max_attempts = 64) {
  MembershipClient::Options options;
  options.max_attempts = max_attempts;
  return MembershipClient(std::make_unique<LossyStore>(std::move(state), faults, seed), options);
}

std::vector<std::string> names(const std::string& prefix, int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(absl::StrCat(prefix, i));
  std::sort(out.begin(), out.end());
  return out;
}

// Every write at kKey went from one epoch to the next, each from the record
// the one before wrote, and each made one change a client asks for.
void expect_linear(const StoreState& state) {
  std::string previous;
  for (const auto& [before, after] : state.history) {
    ASSERT_EQ(before, previous) << "a write did not start from the record before it";
    absl::StatusOr<Membership> b = before.empty() ? Membership() : Membership::decode(before);
    absl::StatusOr<Membership> a = Membership::decode(after);
    ASSERT_TRUE(b.ok() && a.ok()) << before << " -> " << after;
    ASSERT_EQ(a->epoch, b->epoch + 1) << before << " -> " << after;
    std::set<std::string> bm(b->members.begin(), b->members.end());
    std::set<std::string> bj(b->joining.begin(), b->joining.end());
    std::set<std::string> am(a->members.begin(), a->members.end());
    std::set<std::string> aj(a->joining.begin(), a->joining.end());
    const bool start = b->epoch == 0 && aj.empty() && !am.empty();
    auto minus = [](std::set<std::string> x, const std::set<std::string>& y) {
      for (const auto& e : y) x.erase(e);
      return x;
    };
    std::set<std::string> all_b = bm, all_a = am;
    all_b.insert(bj.begin(), bj.end());
    all_a.insert(aj.begin(), aj.end());
    const bool removal = minus(all_b, all_a).size() == 1 && minus(all_a, all_b).empty() &&
                         minus(am, bm).empty();
    const bool join = minus(all_a, all_b).size() == 1 && am == bm &&
                      aj.count(*minus(all_a, all_b).begin()) == 1;
    std::set<std::string> admitted = bm;
    admitted.insert(bj.begin(), bj.end());
    const bool admit = !bj.empty() && aj.empty() && am == admitted;
    EXPECT_TRUE(start || removal || join || admit) << before << " -> " << after;
    previous = after;
  }
}

TEST(MembershipTest, RecordsRoundTripAndWhatEncodeWouldNotWriteIsRefused) {
  Membership m;
  m.epoch = 7;
  m.members = {"ps0", "trainer0", "trainer1"};
  m.joining = {"trainer2"};
  absl::StatusOr<Membership> back = Membership::decode(m.encode());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->epoch, 7);
  EXPECT_EQ(back->members, m.members);
  EXPECT_EQ(back->joining, m.joining);
  EXPECT_TRUE(back->is_member("ps0"));
  EXPECT_FALSE(back->is_member("trainer2"));
  EXPECT_TRUE(back->is_joining("trainer2"));

  const std::string too_long(Membership::kMaxNameBytes + 1, 'a');
  std::string too_many = "1|";
  for (size_t i = 0; i <= Membership::kMaxWorkers; ++i) {
    too_many += absl::StrCat(i == 0 ? "" : ",", "w", 100000 + i);
  }
  too_many += "|";
  for (const std::string& bad :
       {std::string(""), std::string("1"), std::string("1|a"), std::string("1|a|b|c"),
        std::string("0|a|"), std::string("01|a|"), std::string("-1|a|"), std::string("x|a|"),
        std::string("99999999999999999999|a|"), std::string("1|b,a|"), std::string("1|a,a|"),
        std::string("1|a|a"), std::string("1|a||"), std::string("1|a,|"), std::string("1|a b|"),
        std::string("1|a\n|"), std::string("1|a|b,b"), absl::StrCat("1|", too_long, "|"),
        too_many}) {
    EXPECT_FALSE(Membership::decode(bad).ok()) << "decoded '" << bad.substr(0, 40) << "'";
  }
}

TEST(MembershipTest, EachOperationStepsOneEpochAndEndsAtOnceWhenDone) {
  auto state = std::make_shared<StoreState>();
  MembershipClient members = client(state);
  EXPECT_EQ(members.request_join("x").status().code(), absl::StatusCode::kFailedPrecondition);

  absl::StatusOr<Membership> m = members.start({"t1", "t0", "ps0"});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->epoch, 1);
  EXPECT_EQ(m->members, (std::vector<std::string>{"ps0", "t0", "t1"}));
  // Another worker's start finds the record.
  m = client(state).start({"other"});
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->epoch, 1);
  EXPECT_EQ(m->members, (std::vector<std::string>{"ps0", "t0", "t1"}));

  m = members.remove("t1");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->epoch, 2);
  EXPECT_FALSE(m->is_member("t1"));
  EXPECT_EQ(members.remove("t1")->epoch, 2);  // already out

  m = members.request_join("t1b");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->epoch, 3);
  EXPECT_TRUE(m->is_joining("t1b"));
  EXPECT_EQ(members.request_join("t1b")->epoch, 3);  // already joining
  EXPECT_EQ(members.request_join("t0")->epoch, 3);   // already a member

  m = members.admit_joining();
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->epoch, 4);
  EXPECT_EQ(m->members, (std::vector<std::string>{"ps0", "t0", "t1b"}));
  EXPECT_TRUE(m->joining.empty());
  EXPECT_EQ(members.admit_joining()->epoch, 4);  // nobody waiting

  EXPECT_EQ(members.request_join("bad name").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client(std::make_shared<StoreState>()).start({"a", "a"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  expect_linear(*state);
  EXPECT_EQ(state->history.size(), 4u);
}

TEST(MembershipTest, SurvivorsRemovingTheSameWorkerUnderLossMakeOneEpoch) {
  for (uint64_t round = 0; round < 20; ++round) {
    auto state = std::make_shared<StoreState>();
    ASSERT_TRUE(client(state).start(names("w", 8)).ok());
    LossyStore::Faults faults{0.2, 0.2, 0.2, 200};
    std::vector<std::thread> survivors;
    std::vector<absl::Status> results(7);
    for (int i = 0; i < 7; ++i) {
      survivors.emplace_back([&, i] {
        MembershipClient c = client(state, faults, round * 100 + i, 1000);
        results[i] = c.remove("w3").status();
      });
    }
    for (auto& t : survivors) t.join();
    for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
    absl::StatusOr<Membership> m = client(state).current();
    ASSERT_TRUE(m.ok());
    EXPECT_EQ(m->epoch, 2) << "round " << round;
    EXPECT_FALSE(m->is_member("w3"));
    EXPECT_EQ(m->members.size(), 7u);
    expect_linear(*state);
  }
}

TEST(MembershipTest, ConcurrentChangesUnderLossDuplicatesAndReorderingStayLinear) {
  for (uint64_t round = 0; round < 5; ++round) {
    auto state = std::make_shared<StoreState>();
    const std::vector<std::string> initial = names("w", 16);
    ASSERT_TRUE(client(state).start(initial).ok());
    LossyStore::Faults faults{0.15, 0.15, 0.1, 300};
    std::vector<std::thread> threads;
    std::mutex mu;
    std::vector<absl::Status> errors;
    auto record = [&](const absl::Status& s) {
      if (s.ok()) return;
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(s);
    };
    // Four survivors remove two workers each; four replacements join.
    for (int i = 0; i < 4; ++i) {
      threads.emplace_back([&, i] {
        MembershipClient c = client(state, faults, round * 1000 + i, 2000);
        record(c.remove(absl::StrCat("w", 2 * i)).status());
        record(c.remove(absl::StrCat("w", 2 * i + 1)).status());
      });
      threads.emplace_back([&, i] {
        MembershipClient c = client(state, faults, round * 1000 + 10 + i, 2000);
        record(c.request_join(absl::StrCat("n", i)).status());
      });
    }
    // Iteration boundaries meanwhile.
    threads.emplace_back([&] {
      MembershipClient c = client(state, faults, round * 1000 + 99, 2000);
      for (int k = 0; k < 5; ++k) record(c.admit_joining().status());
    });
    for (auto& t : threads) t.join();
    for (const absl::Status& s : errors) ADD_FAILURE() << s;
    absl::StatusOr<Membership> m = client(state).admit_joining();
    ASSERT_TRUE(m.ok()) << m.status();

    std::vector<std::string> want(initial.begin(), initial.end());
    want.erase(std::remove_if(want.begin(), want.end(),
                              [](const std::string& w) {
                                for (int i = 0; i < 8; ++i) {
                                  if (w == absl::StrCat("w", i)) return true;
                                }
                                return false;
                              }),
               want.end());
    for (int i = 0; i < 4; ++i) want.push_back(absl::StrCat("n", i));
    std::sort(want.begin(), want.end());
    EXPECT_EQ(m->members, want) << m->encode();
    EXPECT_TRUE(m->joining.empty());
    EXPECT_EQ(static_cast<size_t>(m->epoch), state->history.size());
    expect_linear(*state);
  }
}

TEST(MembershipTest, AStoreThatAnswersNothingFailsTheOperationWithinItsAttempts) {
  auto state = std::make_shared<StoreState>();
  ASSERT_TRUE(client(state).start({"a", "b"}).ok());
  MembershipClient lost = client(state, {1.0, 0, 0, 0}, 3, 16);
  absl::StatusOr<Membership> m = lost.remove("b");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(m.status().message().find("removing 'b'"), std::string::npos) << m.status();
  EXPECT_NE(m.status().message().find("16 store calls"), std::string::npos) << m.status();
  EXPECT_TRUE(client(state).current()->is_member("b"));
}

TEST(MembershipTest, AwaitChangeWakesOnTheNextEpochAndTimesOutWithoutOne) {
  auto state = std::make_shared<StoreState>();
  ASSERT_TRUE(client(state).start({"a", "b", "c"}).ok());
  MembershipClient waiter = client(state);
  const absl::Time t0 = absl::Now();
  absl::StatusOr<Membership> none = waiter.await_change(1, absl::Milliseconds(300));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(290));

  std::thread remover([&] {
    absl::SleepFor(absl::Milliseconds(100));
    (void)client(state).remove("c");
  });
  absl::StatusOr<Membership> next = waiter.await_change(1, absl::Seconds(30));
  remover.join();
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->epoch, 2);
  EXPECT_FALSE(next->is_member("c"));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
}

TEST(MembershipTest, EveryEpochsRecordStaysReadableAfterLaterOnes) {
  auto state = std::make_shared<StoreState>();
  MembershipClient members = client(state);
  std::vector<std::string> written;
  written.push_back(members.start({"a", "b", "c"})->encode());
  written.push_back(members.remove("c")->encode());
  // The writer of epoch 2 is lost before it keeps the record: at_epoch()
  // finds it as the record now, and the next change keeps it first.
  auto forget = [&](int64_t epoch) {
    std::lock_guard<std::mutex> lock(state->mu);
    state->data.erase(absl::StrCat(kKey, "/epoch/", epoch));
  };
  forget(2);
  ASSERT_TRUE(members.at_epoch(2).ok());
  EXPECT_EQ(members.at_epoch(2)->encode(), written[1]);
  forget(2);
  written.push_back(members.request_join("d")->encode());
  written.push_back(members.admit_joining()->encode());
  for (int64_t e = 1; e <= 4; ++e) {
    absl::StatusOr<Membership> m = client(state).at_epoch(e);
    ASSERT_TRUE(m.ok()) << "epoch " << e << ": " << m.status();
    EXPECT_EQ(m->encode(), written[e - 1]);
  }
  EXPECT_EQ(members.at_epoch(5).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(members.at_epoch(0).status().code(), absl::StatusCode::kInvalidArgument);

  // Lost before keeping it, and moved on by a writer that had read the
  // record before: epoch 6's record is gone for good, and said so.
  written.push_back(members.remove("a")->encode());  // epoch 5
  {
    std::lock_guard<std::mutex> lock(state->mu);
    Membership six = *Membership::decode(written[4]);
    six.epoch = 6;
    six.joining = {"e"};
    Membership seven = six;
    seven.epoch = 7;
    seven.joining.clear();
    state->data[kKey] = seven.encode();
  }
  absl::StatusOr<Membership> lost = members.at_epoch(6);
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kNotFound) << lost.status();
  EXPECT_NE(lost.status().message().find("at epoch 7"), std::string::npos) << lost.status();

  // What is kept under an epoch's key is checked like any record.
  {
    std::lock_guard<std::mutex> lock(state->mu);
    state->data[absl::StrCat(kKey, "/epoch/3")] = written[1];  // epoch 2's
    state->data[absl::StrCat(kKey, "/epoch/4")] = "4|b,,|";
  }
  EXPECT_EQ(members.at_epoch(3).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(members.at_epoch(4).status().code(), absl::StatusCode::kDataLoss);
}

TEST(MembershipTest, OverTheRendezvousStore) {
  auto server = StoreServer::start("127.0.0.1", 0);
  Store store("127.0.0.1", server->port(), absl::Seconds(10));
  MembershipClient members(membership_store(&store));
  EXPECT_EQ(members.current()->epoch, 0);
  ASSERT_TRUE(members.start({"trainer0", "trainer1", "ps0"}).ok());

  Store other_store("127.0.0.1", server->port(), absl::Seconds(10));
  MembershipClient other(membership_store(&other_store));
  absl::StatusOr<Membership> seen;
  std::thread waiter([&] { seen = other.await_change(1, absl::Seconds(20)); });
  absl::StatusOr<Membership> m = members.remove("trainer1");
  waiter.join();
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(seen->encode(), m->encode());
  ASSERT_TRUE(other.request_join("trainer1b").ok());
  m = members.admit_joining();
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->epoch, 4);
  EXPECT_EQ(m->members, (std::vector<std::string>{"ps0", "trainer0", "trainer1b"}));

  // A record someone wrote by hand is reported, not overwritten.
  store.set(kKey, "4|trainer0,,|");
  EXPECT_EQ(members.current().status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(members.remove("trainer0").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(store.get(kKey), "4|trainer0,,|");
}

}  // namespace
}  // namespace ddprpc::rpc
