// What a waiter runs before it sleeps (Future::set_driver in future.h): the
// agent installs one on every call's future, so that a waiting caller reads
// the reply itself.
#pragma once

#include <functional>

#include "absl/time/time.h"

namespace ddprpc::rpc::internal {

// Lets a waiter make progress on what a future waits for on its own thread
// (e.g. read the reply itself) instead of sleeping until another thread
// completes it. It returns when done() (whether the future has completed)
// or at `until` at the latest, or when it cannot help. It must not throw.
struct FutureDriver {
  std::function<void(const std::function<bool()>& done, absl::Time until)> drive;
};

}  // namespace ddprpc::rpc::internal
