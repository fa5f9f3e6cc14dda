// A program that links //rpc and runs init_rpc and shutdown with the default
// options finds its process as it left it: the same environment, the same
// signal dispositions, the scheduling policy it chose for its own thread and
// for the threads that libtorch starts (also from the runtime's threads),
// and the abseil deadlock-detection mode it chose.
#include <ATen/Parallel.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "tests/multiprocess.h"

extern char** environ;

namespace ddprpc {
namespace {

namespace mp = ::ddprpc::testing;

std::vector<std::string> environment() {
  std::vector<std::string> out;
  for (char** e = environ; *e != nullptr; ++e) out.emplace_back(*e);
  std::sort(out.begin(), out.end());
  return out;
}

// The handler of every signal that has one, as "signal:handler:flags".
std::vector<std::string> signal_dispositions() {
  std::vector<std::string> out;
  for (int sig = 1; sig < NSIG; ++sig) {
    struct sigaction action {};
    if (sigaction(sig, nullptr, &action) != 0) continue;
    char line[96];
    std::snprintf(line, sizeof(line), "%d:%p:%x", sig,
                  reinterpret_cast<void*>(action.sa_handler), action.sa_flags);
    out.emplace_back(line);
  }
  return out;
}

// Scheduling policies: of the calling thread, then of libtorch's intra-op
// threads (a parallel_for over more chunks than threads) and of an
// inter-op task, all started from the calling thread.
std::vector<int64_t> policies_of_this_and_libtorch_threads() {
  std::vector<int64_t> out{sched_getscheduler(0)};
  absl::Mutex mu;
  at::parallel_for(0, 64, 1, [&](int64_t, int64_t) {
    const int64_t policy = sched_getscheduler(0);
    absl::MutexLock lock(&mu);
    out.push_back(policy);
  });
  absl::Notification done;
  int64_t inter_op = -1;
  at::launch([&] {
    inter_op = sched_getscheduler(0);
    done.Notify();
  });
  done.WaitForNotification();
  out.push_back(inter_op);
  return out;
}
DDPRPC_REGISTER_FUNCTION(policies_of_this_and_libtorch_threads);

// Takes two new mutexes in both orders (a potential deadlock, never a real
// one) with stderr sent to a file; returns what abseil wrote there.
std::string stderr_of_a_lock_order_cycle() {
  char path[] = "/tmp/process_state_test.XXXXXX";
  const int file = mkstemp(path);
  if (file < 0) return "mkstemp failed";
  unlink(path);
  std::fflush(stderr);
  const int saved = dup(STDERR_FILENO);
  dup2(file, STDERR_FILENO);
  {
    auto* a = new absl::Mutex;
    auto* b = new absl::Mutex;
    a->Lock();
    b->Lock();
    b->Unlock();
    a->Unlock();
    b->Lock();
    a->Lock();
    a->Unlock();
    b->Unlock();
    delete a;
    delete b;
  }
  std::fflush(stderr);
  dup2(saved, STDERR_FILENO);
  close(saved);
  std::string text;
  char buf[4096];
  ssize_t n;
  lseek(file, 0, SEEK_SET);
  while ((n = read(file, buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
  close(file);
  return text;
}

bool reports_deadlock(const std::string& text) {
  return text.find("Potential Mutex deadlock") != std::string::npos;
}

MULTIPROCESS_TEST(ProcessStateTest, InitRpcAndShutdownWithDefaultOptionsChangeNothingProcessWide,
                  2) {
  // The program's own choices, made before the library starts.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kReport);
  const bool detection_compiled_in = reports_deadlock(stderr_of_a_lock_order_cycle());
  const std::vector<std::string> env_before = environment();
  const std::vector<std::string> signals_before = signal_dispositions();
  const int policy_before = sched_getscheduler(0);
  ASSERT_EQ(policy_before, SCHED_OTHER);

  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, rpc::RpcBackendOptions{});
  const std::string peer = mp::worker_name(1 - mp::rank());
  // The threads that run requests, and the libtorch threads they start.
  for (int64_t policy :
       rpc::rpc_sync<std::vector<int64_t>>(peer, "policies_of_this_and_libtorch_threads")) {
    EXPECT_EQ(policy, SCHED_OTHER) << "a thread of " << peer << " runs under another policy";
  }
  // Several at once, so that the worker pool runs some.
  std::vector<rpc::Future<std::vector<int64_t>>> calls;
  for (int i = 0; i < 8; ++i) {
    calls.push_back(
        rpc::rpc_async<std::vector<int64_t>>(peer, "policies_of_this_and_libtorch_threads"));
  }
  for (auto& call : calls) {
    for (int64_t policy : call.value()) EXPECT_EQ(policy, SCHED_OTHER);
  }
  EXPECT_EQ(environment(), env_before) << "init_rpc changed the environment";
  rpc::shutdown();

  EXPECT_EQ(environment(), env_before) << "the environment changed";
  EXPECT_EQ(signal_dispositions(), signals_before) << "a signal's disposition changed";
  EXPECT_EQ(sched_getscheduler(0), policy_before);
  // libtorch threads started from the program's thread after the runtime ran.
  for (int64_t policy : policies_of_this_and_libtorch_threads()) EXPECT_EQ(policy, SCHED_OTHER);
  if (detection_compiled_in) {
    EXPECT_TRUE(reports_deadlock(stderr_of_a_lock_order_cycle()))
        << "abseil's deadlock detection no longer reports: its mode changed";
  } else {
    std::fprintf(stderr, "this abseil has no deadlock detection compiled in; its mode is not checked\n");
  }
}

}  // namespace
}  // namespace ddprpc
