// ThreadSanitizer's view of absl::Mutex, for --config=tsan only.
//
// Debian's abseil is not built with TSan, so TSan cannot see the
// happens-before edges that absl::Mutex creates and would report every
// access that a mutex guards. The link wraps (-Wl,--wrap) the Mutex entry
// points our code calls; each wrapper tells TSan about the lock operation
// (__tsan_mutex_* annotations) around the real one. While a thread waits
// inside Await* it holds the mutex from TSan's point of view only between
// the pre/post annotations, in which TSan ignores the accesses (e.g. the
// waiters' conditions, evaluated by whichever thread unlocks).
#include <sanitizer/tsan_interface.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

using absl::Condition;
using absl::Mutex;

extern "C" {

void __real__ZN4absl7debian35Mutex4LockEv(Mutex* mu);
void __real__ZN4absl7debian35Mutex6UnlockEv(Mutex* mu);
bool __real__ZN4absl7debian35Mutex7TryLockEv(Mutex* mu);
void __real__ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE(Mutex* mu, const Condition& c);
bool __real__ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE(
    Mutex* mu, const Condition& c, absl::Duration d);
bool __real__ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE(
    Mutex* mu, const Condition& c, absl::Time t);
void __real__ZN4absl7debian35MutexD1Ev(Mutex* mu);

void __wrap__ZN4absl7debian35Mutex4LockEv(Mutex* mu) {
  __tsan_mutex_pre_lock(mu, 0);
  __real__ZN4absl7debian35Mutex4LockEv(mu);
  __tsan_mutex_post_lock(mu, 0, 0);
}

void __wrap__ZN4absl7debian35Mutex6UnlockEv(Mutex* mu) {
  __tsan_mutex_pre_unlock(mu, 0);
  __real__ZN4absl7debian35Mutex6UnlockEv(mu);
  __tsan_mutex_post_unlock(mu, 0);
}

bool __wrap__ZN4absl7debian35Mutex7TryLockEv(Mutex* mu) {
  __tsan_mutex_pre_lock(mu, __tsan_mutex_try_lock);
  const bool locked = __real__ZN4absl7debian35Mutex7TryLockEv(mu);
  __tsan_mutex_post_lock(mu, locked ? __tsan_mutex_try_lock : __tsan_mutex_try_lock_failed, 0);
  return locked;
}

// Await*: the mutex is released while waiting and held again on return.
#define DDPRPC_AWAIT(call)               \
  __tsan_mutex_pre_unlock(mu, 0);        \
  __tsan_mutex_post_unlock(mu, 0);       \
  __tsan_mutex_pre_lock(mu, 0);          \
  auto result = call;                    \
  __tsan_mutex_post_lock(mu, 0, 0);      \
  return result

void __wrap__ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE(Mutex* mu, const Condition& c) {
  __tsan_mutex_pre_unlock(mu, 0);
  __tsan_mutex_post_unlock(mu, 0);
  __tsan_mutex_pre_lock(mu, 0);
  __real__ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE(mu, c);
  __tsan_mutex_post_lock(mu, 0, 0);
}

bool __wrap__ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE(
    Mutex* mu, const Condition& c, absl::Duration d) {
  DDPRPC_AWAIT(__real__ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE(mu, c, d));
}

bool __wrap__ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE(
    Mutex* mu, const Condition& c, absl::Time t) {
  DDPRPC_AWAIT(__real__ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE(mu, c, t));
}

void __wrap__ZN4absl7debian35MutexD1Ev(Mutex* mu) {
  __tsan_mutex_destroy(mu, 0);
  __real__ZN4absl7debian35MutexD1Ev(mu);
}

}  // extern "C"

// Narrow suppressions for what TSan cannot see in Debian's uninstrumented
// libraries:
// - gRPC's core and the libraries it calls (its allocations, channel
//   arguments, event engine, upb, c-ares; abseil's random pool, statuses and
//   cords), and abseil's deadlock-detection graph;
// - grpcpp's inline op sets, which fill and finish operations whose
//   hand-off between threads happens inside gRPC's completion queue;
// - grpcpp's callback handlers, which create a reactor on one of gRPC's
//   threads and call its OnDone and OnCancel on others, ordered inside
//   gRPC's core (the store's reactor reads its own members there).
extern "C" const char* __tsan_default_suppressions() {
  return "called_from_lib:libgrpc.so.29\n"
         "called_from_lib:libgpr.so.29\n"
         "called_from_lib:libgrpc++.so.1.51\n"
         "called_from_lib:libabsl_graphcycles_internal.so.20220623\n"
         "called_from_lib:libabsl_random_internal_pool_urbg.so.20220623\n"
         "called_from_lib:libabsl_status.so.20220623\n"
         "called_from_lib:libabsl_cord.so.20220623\n"
         "called_from_lib:libabsl_cord_internal.so.20220623\n"
         "called_from_lib:libupb.so.29\n"
         "called_from_lib:libcares.so.2\n"
         "race:grpc::internal::CallOpSet\n"
         "race:grpc::internal::CallbackBidiHandler\n"
         "race:ddprpc::rpc::StoreServer::Service::Call::OnCancel\n";
}
