// How the runtime's own threads are scheduled: the threads that read
// streams, run requests and fire timers.
//
// With batch scheduling (RpcBackendOptions::batch_scheduling, off unless
// the program asks for it) each such thread runs as SCHED_BATCH (sched(7))
// once it calls apply_thread_policy(true). A thread of this class that a
// message wakes does not preempt the thread running on its core; it runs
// at that core's next scheduling point (the running thread blocks or uses
// up its slice). CPU shares, nice values and the waking of idle cores are
// unchanged. On a host with more runnable threads than cores, a worker that
// answers many callers at once (a batch completed by its last request, a
// fan-out of calls) then sends every reply before the callers it wakes take
// its core, instead of being cut after each one. Threads started by these
// threads (a handler's own threads, libtorch's intra-op pool) inherit the
// policy, as Linux does for every policy but the real-time ones.
//
// The setting belongs to whoever starts the thread (an agent's pools, a
// transport made with TransportOptions::batch_scheduling): nothing here is
// per process, and threads the runtime did not start are never changed.
#pragma once

namespace ddprpc::rpc::internal {

// Gives the calling thread the runtime's policy: SCHED_BATCH when `batch`,
// otherwise nothing. The first thing every thread the runtime starts does.
// A refusal by the kernel is ignored (the thread stays as it was).
void apply_thread_policy(bool batch);

}  // namespace ddprpc::rpc::internal
