// Fault injection for tests: named points on the runtime's threads (the
// transport's pollers and readers, the agent's timer and reply sender, the
// store's handlers, ...) that throw when a test arms them, to check that an
// exception on any of those threads fails only the stream or call at hand.
//
//   internal::arm_fault("agent.serve");        // the next request's handling throws
//
// An unarmed point costs one relaxed atomic load.
#pragma once

#include <atomic>
#include <string>

namespace ddprpc::rpc::internal {

namespace fault_detail {
extern std::atomic<int> g_armed;  // points armed, any name
void hit(const char* point);
}  // namespace fault_detail

// Throws std::runtime_error("injected fault at <point>") if `point` is armed,
// using up one arming.
inline void fault_point(const char* point) {
  if (fault_detail::g_armed.load(std::memory_order_relaxed) > 0) fault_detail::hit(point);
}

// Arms `point` to throw the next `times` times it is reached, after
// letting the first `skip` pass (e.g. the arming call's own reply).
void arm_fault(const std::string& point, int times = 1, int skip = 0);
// How many times `point` has thrown so far.
int fault_count(const std::string& point);

}  // namespace ddprpc::rpc::internal
