#include "rpc/core/internal/fault.h"

#include <map>
#include <stdexcept>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ddprpc::rpc::internal {
namespace {

struct Points {
  absl::Mutex mu;
  std::map<std::string, int> armed ABSL_GUARDED_BY(mu);
  std::map<std::string, int> skip ABSL_GUARDED_BY(mu);
  std::map<std::string, int> thrown ABSL_GUARDED_BY(mu);
};

Points& points() {
  static auto* p = new Points();
  return *p;
}

}  // namespace

namespace fault_detail {

std::atomic<int> g_armed{0};

void hit(const char* point) {
  Points& p = points();
  {
    absl::MutexLock lock(&p.mu);
    auto it = p.armed.find(point);
    if (it == p.armed.end() || it->second == 0) return;
    int& skip = p.skip[point];
    if (skip > 0) {
      --skip;
      return;
    }
    --it->second;
    g_armed.fetch_sub(1, std::memory_order_relaxed);
    ++p.thrown[point];
  }
  throw std::runtime_error(std::string("injected fault at ") + point);
}

}  // namespace fault_detail

void arm_fault(const std::string& point, int times, int skip) {
  Points& p = points();
  absl::MutexLock lock(&p.mu);
  p.armed[point] += times;
  p.skip[point] += skip;
  fault_detail::g_armed.fetch_add(times, std::memory_order_relaxed);
}

int fault_count(const std::string& point) {
  Points& p = points();
  absl::MutexLock lock(&p.mu);
  auto it = p.thrown.find(point);
  return it == p.thrown.end() ? 0 : it->second;
}

}  // namespace ddprpc::rpc::internal
