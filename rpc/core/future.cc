#include "rpc/core/future.h"

#include "rpc/core/internal/future_driver.h"
#include "rpc/core/internal/held_work.h"

namespace ddprpc::rpc {
namespace internal {

void run_held_work() {
  if (HeldWork* held = HeldWork::current()) held->run();
}

void run_driver(const FutureDriver& driver, const std::function<bool()>& done, absl::Time until) {
  HeldWork::Suspend not_holding;  // see Suspend
  driver.drive(done, until);
}

}  // namespace internal

void send_completed_replies() { internal::run_held_work(); }

}  // namespace ddprpc::rpc
