// How the runtime's own threads are scheduled: the threads that read
// streams, run requests and fire timers.
//
// By default each such thread runs as SCHED_BATCH (sched(7)) once it calls
// apply_thread_policy(). A thread of this class that a message wakes does
// not preempt the thread running on its core; it runs at that core's next
// scheduling point (the running thread blocks or uses up its slice). CPU
// shares, nice values and the waking of idle cores are unchanged. On a host
// with more runnable threads than cores, a worker that answers many callers
// at once (a batch completed by its last request, a fan-out of calls) then
// sends every reply before the callers it wakes take its core, instead of
// being cut after each one. Threads started by these threads (a handler's
// own threads, libtorch's intra-op pool) inherit the policy, as Linux
// does for every policy but the real-time ones.
//
// The setting is per process. Switched off (set_batch_scheduling(false), or
// DDPRPC_SCHED_BATCH=0 in the environment, which wins), apply_thread_policy()
// leaves threads as they are.
#pragma once

namespace ddprpc::rpc::internal {

inline constexpr char kSchedBatchEnv[] = "DDPRPC_SCHED_BATCH";

// Whether threads that call apply_thread_policy() from now on run as
// SCHED_BATCH: `on` unless DDPRPC_SCHED_BATCH is "0" (read at each call).
// Threads that applied the policy before keep theirs.
void set_batch_scheduling(bool on);
bool batch_scheduling();

// Gives the calling thread the runtime's policy: the first thing every
// thread the runtime starts does. A refusal by the kernel is ignored (the
// thread stays as it was).
void apply_thread_policy();

}  // namespace ddprpc::rpc::internal
