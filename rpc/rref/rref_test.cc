// Remote references across real processes: creation, method calls,
// to_here, passing RRefs between workers, reference counting, failures.
#include "rpc/rref/rref.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>

#include <atomic>

#include "absl/time/clock.h"

#include "gtest/gtest.h"
#include "tests/multiprocess.h"

namespace rpc = ddprpc::rpc;
namespace mp = ddprpc::testing;

namespace {

std::atomic<int> g_tables_created{0}, g_tables_destroyed{0};

class Table {
 public:
  Table(int64_t rows, int64_t dim) {
    if (rows <= 0) throw std::invalid_argument("Table needs rows > 0, got " + std::to_string(rows));
    weight_ = at::arange(rows * dim, at::kFloat).reshape({rows, dim});
    ++g_tables_created;
  }
  ~Table() { ++g_tables_destroyed; }
  at::Tensor lookup(at::Tensor indices) { return weight_.index_select(0, indices); }
  int64_t rows() { return weight_.size(0); }
  std::string where() { return rpc::get_worker_info().name; }

 private:
  at::Tensor weight_;
};
static auto table_registration = rpc::register_class<Table>("Table")
                                     .constructor<int64_t, int64_t>()
                                     .method("lookup", &Table::lookup)
                                     .method("rows", &Table::rows)
                                     .method("where", &Table::where);

at::Tensor add(at::Tensor a, at::Tensor b) { return a + b; }
DDPRPC_REGISTER_FUNCTION(add);

// A class whose construction takes a while (creation is asynchronous).
class SlowToBuild {
 public:
  explicit SlowToBuild(int64_t ms) : value_(ms) { absl::SleepFor(absl::Milliseconds(ms)); }
  int64_t value() const { return value_; }

 private:
  int64_t value_;
};
static auto slow_registration =
    rpc::register_class<SlowToBuild>("SlowToBuild").constructor<int64_t>();

// Uses an RRef it was given and hands it back.
rpc::RRef<Table> bounce(rpc::RRef<Table> table, int64_t expected_rows) {
  if (table.rpc_sync(&Table::rows) != expected_rows) throw std::runtime_error("wrong rows");
  if (table.is_owner() && table.local_value()->rows() != expected_rows) {
    throw std::runtime_error("wrong local rows");
  }
  return table;
}
DDPRPC_REGISTER_FUNCTION(bounce);

// Keeps RRefs alive until drop_kept().
absl::Mutex g_kept_mu;
std::vector<rpc::RRef<Table>> g_kept;
int64_t keep(rpc::RRef<Table> table) {
  absl::MutexLock lock(&g_kept_mu);
  g_kept.push_back(table);
  return static_cast<int64_t>(g_kept.size());
}
DDPRPC_REGISTER_FUNCTION(keep);
int64_t drop_kept() {
  absl::MutexLock lock(&g_kept_mu);
  int64_t n = g_kept.size();
  g_kept.clear();
  return n;
}
DDPRPC_REGISTER_FUNCTION(drop_kept);

std::vector<int64_t> table_counts() {
  return {g_tables_created.load(), g_tables_destroyed.load(),
          static_cast<int64_t>(rpc::owned_rrefs(*rpc::current_agent()))};
}
DDPRPC_REGISTER_FUNCTION(table_counts);

// Value methods: a tensor's row, and an integer's sum with another.
static const bool value_methods_registered = [] {
  rpc::register_value_method("row", [](const at::Tensor& t, int64_t i) { return t[i]; });
  rpc::register_value_method("plus", [](int64_t v, int64_t k) { return v + k; });
  return true;
}();

// A class no one registered: a local owner RRef of it still works.
struct Unregistered {
  explicit Unregistered(int64_t v) : value(v) {}
  int64_t value;
};

// Receives an RRef of an unregistered object owned by the caller: it can
// hold and return it, not call its methods.
rpc::RRef<Unregistered> hold_unregistered(rpc::RRef<Unregistered> object) {
  if (object.is_owner()) throw std::runtime_error("expected a user RRef");
  try {
    object.rpc_sync<int64_t>("value");
    throw std::runtime_error("a method of an unregistered class ran");
  } catch (const rpc::RpcError& e) {
    if (std::string(e.what()).find("unregistered class") == std::string::npos) throw;
  }
  return object;
}
DDPRPC_REGISTER_FUNCTION(hold_unregistered);

void init(int world_size) { rpc::init_rpc(mp::worker_name(), mp::rank(), world_size, mp::backend_options()); }

MULTIPROCESS_TEST(RRefTest, CreateCallFetch, 3) {
  init(3);
  if (mp::rank() == 0) {
    rpc::RRef<Table> table = rpc::remote<Table>("worker1", 4, 3);
    EXPECT_EQ(table.owner_name(), "worker1");
    EXPECT_FALSE(table.is_owner());
    EXPECT_EQ(table.rpc_sync(&Table::rows), 4);
    EXPECT_EQ(table.rpc_sync(&Table::where), "worker1");
    EXPECT_TRUE(table.confirmed_by_owner());
    at::Tensor rows = table.rpc_async(&Table::lookup, at::arange(2, at::kLong)).value();
    EXPECT_TRUE(at::equal(rows, at::arange(6, at::kFloat).reshape({2, 3})));

    // A method's result kept on the owner, then fetched.
    rpc::RRef<at::Tensor> looked_up = table.remote(&Table::lookup, at::full({1}, 3, at::kLong));
    EXPECT_EQ(looked_up.owner_name(), "worker1");
    EXPECT_TRUE(at::equal(looked_up.to_here(), at::arange(9, 12, at::kFloat).reshape({1, 3})));

    // A function's result kept on worker2.
    rpc::RRef<at::Tensor> sum = rpc::remote<at::Tensor>("worker2", "add", at::ones({2}), at::ones({2}));
    EXPECT_TRUE(at::equal(sum.to_here(), at::full({2}, 2.0)));
    EXPECT_THROW(sum.local_value(), rpc::RpcError);

    // A local owner RRef: the value itself, not a copy.
    at::Tensor param = at::ones({3});
    rpc::RRef<at::Tensor> local(param);
    EXPECT_TRUE(local.is_owner());
    EXPECT_EQ(local.local_value().data_ptr(), param.data_ptr());
    EXPECT_TRUE(at::equal(local.to_here(), param));
  }
  rpc::shutdown();
}

// rpc::remote to the caller itself, then local_value() before the create
// request was served: it waits for the object (as PyTorch's owner RRef
// does) instead of finding nothing, also while this thread's other call
// holds the client queue's background reader off.
MULTIPROCESS_TEST(RRefTest, LocalValueOfARemoteToSelfWaitsForCreation, 2) {
  init(2);
  if (mp::rank() == 0) {
    rpc::SyncCallScope waits_here;
    rpc::Future<at::Tensor> other =
        rpc::rpc_async<at::Tensor>("worker1", "add", at::ones({2}), at::ones({2}));
    const absl::Time start = absl::Now();
    rpc::RRef<SlowToBuild> slow = rpc::remote<SlowToBuild>("worker0", int64_t{200});
    ASSERT_TRUE(slow.is_owner());
    EXPECT_EQ(slow.local_value()->value(), 200);
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
    EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "waited for the create call's timeout";
    EXPECT_TRUE(at::equal(other.value(), at::full({2}, 2.0)));
  }
  rpc::shutdown();
}

// A peer may name an id of this worker before this worker has made it (a
// fetch of the next id, here): the RRef then made under that id answers
// it, instead of leaving it waiting and its placeholder counted forever.
MULTIPROCESS_TEST(RRefTest, ALocalRRefTakesOverThePlaceholderOfItsId, 2) {
  init(2);
  auto* store = &rpc::current_agent()->store();
  auto owned = [] { return std::stoll(rpc::get_debug_info()["rref.owned"]); };
  if (mp::rank() == 0) {
    rpc::RRef<int64_t> first(int64_t{1});
    const int64_t next = first.state().id.local + 1;
    const int64_t before = owned();
    store->set("next", std::to_string(next));
    // Worker1's fetch of (0, next) has made a placeholder here.
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (owned() == before && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
    ASSERT_EQ(owned(), before + 1);
    rpc::RRef<int64_t> second(int64_t{42});
    ASSERT_EQ(second.state().id.local, next);
    store->get("fetched");
  } else {
    const int64_t next = std::stoll(store->get("next"));
    rpc::Future<int64_t> fetch = rpc::rpc_async<int64_t>(
        rpc::CallOptions{absl::Seconds(30)}, "worker0", "__rref.fetch", int64_t{0}, next);
    EXPECT_EQ(fetch.value(), 42);
    store->set("fetched", "1");
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(RRefTest, CreationErrorSurfacesAtUse, 2) {
  init(2);
  if (mp::rank() == 0) {
    rpc::RRef<Table> bad = rpc::remote<Table>("worker1", -5, 2);  // returns at once
    try {
      bad.rpc_sync(&Table::rows);
      ADD_FAILURE() << "using a failed RRef succeeded";
    } catch (const rpc::RpcError& e) {
      EXPECT_NE(std::string(e.what()).find("Table needs rows > 0, got -5"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("worker1"), std::string::npos) << e.what();
    }
    rpc::RRef<at::Tensor> missing = rpc::remote<at::Tensor>("worker1", "no_such_function", 1);
    EXPECT_THROW(missing.to_here(), rpc::RpcError);
    rpc::RRef<at::Tensor> wrong_args = rpc::remote<at::Tensor>("worker1", "add", 1, 2);
    EXPECT_THROW(wrong_args.to_here(), rpc::RpcError);
  }
  rpc::shutdown();
}

// PyTorch's rref.rpc_sync().size(): methods of a value run where it lives.
MULTIPROCESS_TEST(RRefTest, MethodsOfAValueRunOnItsOwner, 3) {
  init(3);
  if (mp::rank() == 0) {
    rpc::RRef<at::Tensor> sum =
        rpc::remote<at::Tensor>("worker1", "add", at::ones({2, 3}), at::ones({2, 3}));
    EXPECT_EQ(sum.rpc_sync<std::vector<int64_t>>("size"), (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(sum.rpc_sync<int64_t>("size", 1), 3);
    EXPECT_EQ(sum.rpc_sync<int64_t>(rpc::CallOptions{absl::Seconds(5)}, "numel"), 6);
    at::Tensor flat = sum.rpc_async<at::Tensor>("view", std::vector<int64_t>{-1}).value();
    EXPECT_TRUE(at::equal(flat, at::full({6}, 2.0)));
    EXPECT_TRUE(at::equal(sum.rpc_sync<at::Tensor>("row", 1), at::full({3}, 2.0)));
    // A result kept on the owner.
    rpc::RRef<at::Tensor> total = sum.remote<at::Tensor>("sum");
    EXPECT_EQ(total.owner_name(), "worker1");
    EXPECT_DOUBLE_EQ(total.rpc_sync<double>("item"), 12.0);
    // An RRef of an integer, owned here.
    rpc::RRef<int64_t> five(int64_t{5});
    EXPECT_EQ(five.rpc_sync<int64_t>("plus", 2), 7);
    // Errors name what is wrong.
    auto message = [](auto&& call) -> std::string {
      try {
        call();
      } catch (const rpc::RpcError& e) {
        return e.what();
      }
      return "no error";
    };
    EXPECT_NE(message([&] { sum.rpc_sync<int64_t>("no_such_method"); }).find("no value method"),
              std::string::npos);
    EXPECT_NE(message([&] { sum.rpc_sync<int64_t>("size", 1, 2); }).find("takes 0 or 1 arguments"),
              std::string::npos);
    EXPECT_NE(message([&] { five.rpc_sync<int64_t>("numel"); }).find("argument 1"),
              std::string::npos);
    EXPECT_NE(message([&] { sum.rpc_sync<int64_t>("size", 7); }).find("worker1"),
              std::string::npos);
    // By name works on objects too.
    rpc::RRef<Table> table = rpc::remote<Table>("worker2", 4, 3);
    EXPECT_EQ(table.rpc_sync<int64_t>("rows"), 4);
  }
  rpc::shutdown();
}

// PyTorch's RRef(obj): a local owner RRef of an object, registered or not.
MULTIPROCESS_TEST(RRefTest, LocalOwnerRRefOfAnObject, 2) {
  init(2);
  if (mp::rank() == 0) {
    auto object = std::make_shared<Unregistered>(41);
    std::weak_ptr<Unregistered> watch = object;
    {
      rpc::RRef<Unregistered> rref(object);
      object.reset();
      EXPECT_TRUE(rref.is_owner());
      EXPECT_EQ(rref.local_value()->value, 41);
      rpc::RRef<Unregistered> back =
          rpc::rpc_sync<rpc::RRef<Unregistered>>("worker1", "hold_unregistered", rref);
      EXPECT_TRUE(back.is_owner());
      EXPECT_EQ(back.local_value().get(), rref.local_value().get());

      // A registered class: other workers call its methods.
      rpc::RRef<Table> table(std::make_shared<Table>(3, 2));
      EXPECT_EQ(rpc::rpc_sync<rpc::RRef<Table>>("worker1", "bounce", table, 3).local_value().get(),
                table.local_value().get());
    }
    // Every reference is gone once worker1's forks are deleted.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (!watch.expired() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
    EXPECT_TRUE(watch.expired()) << "the object outlived its RRefs";
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(RRefTest, PassedAcrossWorkersAndBack, 3) {
  init(3);
  if (mp::rank() == 0) {
    rpc::RRef<Table> table = rpc::remote<Table>("worker1", 7, 2);
    // worker0 -> worker2 (a user) -> back to worker0.
    rpc::RRef<Table> back = rpc::rpc_sync<rpc::RRef<Table>>("worker2", "bounce", table, 7);
    EXPECT_EQ(back.rpc_sync(&Table::rows), 7);
    // worker0 -> worker1 (the owner: local_value works there) -> back.
    rpc::RRef<Table> back2 = rpc::rpc_sync<rpc::RRef<Table>>("worker1", "bounce", back, 7);
    EXPECT_EQ(back2.owner_name(), "worker1");
    EXPECT_EQ(back2.rpc_sync(&Table::rows), 7);
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(RRefTest, ForkStormDestroysOnceWhenAllDropped, 3) {
  init(3);
  if (mp::rank() == 0) {
    {
      rpc::RRef<Table> table = rpc::remote<Table>("worker1", 2, 2);
      std::vector<rpc::Future<int64_t>> futures;
      for (int i = 0; i < 50; ++i) {
        futures.push_back(rpc::rpc_async<int64_t>("worker2", "keep", table));
        futures.push_back(rpc::rpc_async<int64_t>("worker1", "keep", table));
      }
      rpc::wait_all(futures);
      EXPECT_EQ(rpc::rpc_sync<std::vector<int64_t>>("worker1", "table_counts")[1], 0);
      EXPECT_EQ(rpc::rpc_sync<int64_t>("worker2", "drop_kept"), 50);
      EXPECT_EQ(rpc::rpc_sync<std::vector<int64_t>>("worker1", "table_counts")[1], 0)
          << "destroyed while worker0 and worker1 still hold references";
      EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "drop_kept"), 50);
    }  // worker0's own reference goes here
    std::vector<int64_t> counts;
    absl::Time deadline = absl::Now() + absl::Seconds(20);
    do {
      counts = rpc::rpc_sync<std::vector<int64_t>>("worker1", "table_counts");
      if (counts[1] == 1 && counts[2] == 0) break;
      absl::SleepFor(absl::Milliseconds(20));
    } while (absl::Now() < deadline);
    EXPECT_EQ(counts[0], 1);  // created once
    EXPECT_EQ(counts[1], 1);  // destroyed exactly once
    EXPECT_EQ(counts[2], 0);  // nothing left in the owner's table
  }
  auto agent = rpc::current_agent();
  rpc::shutdown();
  EXPECT_EQ(rpc::rrefs_alive_at_shutdown(*agent), 0);
  EXPECT_EQ(g_tables_created.load(), g_tables_destroyed.load());
}

MULTIPROCESS_TEST(RRefTest, LiveReferenceIsReportedAtShutdown, 2) {
  init(2);
  rpc::RRef<Table> kept;
  if (mp::rank() == 0) kept = rpc::remote<Table>("worker1", 1, 1);
  if (mp::rank() == 0) {
    EXPECT_EQ(kept.rpc_sync(&Table::rows), 1);
  }
  auto agent = rpc::current_agent();
  rpc::shutdown();
  // worker0 still holds a reference, so worker1 reports one live RRef.
  EXPECT_EQ(rpc::rrefs_alive_at_shutdown(*agent), mp::rank() == 1 ? 1 : 0);
}

// A worker that dies holding an RRef never deletes it: its owner keeps the
// value until the program says the worker is gone for good.
MULTIPROCESS_TEST(RRefTest, ForksOfADeadHolderGoWhenTheProgramReleasesThem, 3) {
  init(3);
  auto& store = rpc::current_agent()->store();
  if (mp::rank() == 2) {
    rpc::RRef<Table> held = rpc::remote<Table>("worker1", 2, 1);
    EXPECT_EQ(held.rpc_sync(&Table::rows), 2);  // created: the owner counts our fork
    store.set("held", "1");
    mp::die_abruptly();
  }
  if (mp::rank() == 0) {
    store.get("held");
    auto counts = [] { return rpc::rpc_sync<std::vector<int64_t>>("worker1", "table_counts"); };
    absl::SleepFor(absl::Milliseconds(500));  // worker2's end reaches worker1
    EXPECT_EQ(counts()[2], 1) << "the dead worker's RRef was released without being asked";
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "release_forks_of", std::string("worker2")), 1);
    const std::vector<int64_t> after = counts();
    EXPECT_EQ(after[1], 1);  // the table was destroyed
    EXPECT_EQ(after[2], 0);  // and its entry is gone
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "release_forks_of", std::string("worker2")), 0);
    EXPECT_THROW(rpc::rpc_sync<int64_t>("worker1", "release_forks_of", std::string("worker1")),
                 rpc::RpcError);
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(RRefTest, DeadOwnerFailsCalls, 3) {
  init(3);
  if (mp::rank() == 0) {
    rpc::RRef<Table> table = rpc::remote<Table>("worker1", 3, 1);
    EXPECT_EQ(table.rpc_sync(&Table::rows), 3);
    rpc::rpc_async("worker1", "die");  // the owner goes away
    absl::Time start = absl::Now();
    bool failed = false;
    while (!failed && absl::Now() - start < absl::Seconds(20)) {
      try {
        table.rpc_sync(&Table::rows);
        absl::SleepFor(absl::Milliseconds(20));
      } catch (const rpc::RpcError& e) {
        failed = true;
        EXPECT_EQ(e.code(), rpc::ErrorCode::kUnavailable) << e.what();
      }
    }
    EXPECT_TRUE(failed);
    EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  }
  rpc::shutdown();
}

int64_t release_forks_of(std::string worker) { return rpc::release_forks_held_by(worker); }
DDPRPC_REGISTER_FUNCTION(release_forks_of);

int64_t die() {
  std::thread([] {
    absl::SleepFor(absl::Milliseconds(50));
    mp::die_abruptly();
  }).detach();
  return 0;
}
DDPRPC_REGISTER_FUNCTION(die);

}  // namespace
