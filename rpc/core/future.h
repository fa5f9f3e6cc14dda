// rpc::Future<T>: the result of an asynchronous call, like torch.futures.Future.
//
// A Future is a shared handle: copies refer to the same state. It completes
// once, with a value (set_result) or an error (set_error). wait()/value()
// block and rethrow the error; callbacks run exactly once, on the thread that
// completes the future (or at once when added to a completed future), and so
// must not block. A callback that throws is logged and ignored: its
// exception never reaches the completing thread. Future<void> completes
// without a value.
#pragma once

#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "rpc/core/errors.h"

namespace ddprpc::rpc {

template <typename T>
class Future;

namespace internal {

// Logs the exception of a done callback (errors.cc).
void report_callback_error(std::exception_ptr error) noexcept;

template <typename T>
struct Stored {
  using type = T;
};
template <>
struct Stored<void> {
  using type = std::monostate;
};

template <typename T>
struct IsFuture : std::false_type {};
template <typename T>
struct IsFuture<Future<T>> : std::true_type {};

// Scheduling the agent hooks into waits (internal/held_work.h,
// internal/future_driver.h); defined in future.cc.
struct FutureDriver;
// Before a thread waits: runs the work it holds back (HeldWork).
void run_held_work();
// Runs `driver` (a waiter helping its future along) holding nothing back.
void run_driver(const FutureDriver& driver, const std::function<bool()>& done, absl::Time until);

}  // namespace internal

// In a request handler: sends now the replies of earlier requests whose
// futures this thread has completed (async execution, e.g. the last caller
// of a batch answering everyone), which otherwise go out when the handler
// returns. PyTorch's Future.set_result sends them before it returns; a
// handler that times its batch the same way calls this first. Elsewhere it
// does nothing.
void send_completed_replies();

namespace internal {

template <typename T>
struct FutureState {
  using Callback = std::function<void(const Future<T>&)>;
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  // Run by wait() before it sleeps; dropped on completion.
  std::shared_ptr<const FutureDriver> driver ABSL_GUARDED_BY(mu);
  // Written once before `done` becomes true; read-only afterwards.
  std::optional<typename Stored<T>::type> value;
  std::exception_ptr error;
  std::vector<Callback> callbacks ABSL_GUARDED_BY(mu);
  // The completing thread still runs callbacks: those added meanwhile by
  // other threads queue behind them (so that a callback added after
  // completion sees what the earlier ones did, e.g. then()'s futures
  // completed).
  bool running_callbacks ABSL_GUARDED_BY(mu) = false;
  std::thread::id completing_thread ABSL_GUARDED_BY(mu);
};

}  // namespace internal

template <typename T>
class Future {
 public:
  using value_type = T;
  using stored_type = typename internal::Stored<T>::type;

  // A new, not yet completed future. Completing is allowed through any
  // handle (set_* are const, like the shared state they write once).
  Future() : state_(std::make_shared<State>()) {}

  bool completed() const {
    absl::MutexLock lock(&state_->mu);
    return state_->done;
  }

  // True once completed with an error.
  bool has_error() const {
    absl::MutexLock lock(&state_->mu);
    return state_->done && state_->error != nullptr;
  }

  // Blocks until completed; rethrows the error if there is one.
  void wait() const {
    wait_done(absl::InfiniteFuture());
    if (state_->error) std::rethrow_exception(state_->error);
  }

  // Blocks at most `timeout`; true when the future has completed. Never throws.
  bool wait_for(absl::Duration timeout) const {
    return wait_done(timeout == absl::InfiniteDuration() ? absl::InfiniteFuture()
                                                         : absl::Now() + timeout);
  }

  // Blocks until completed and returns the value, or rethrows the error.
  const stored_type& value() const {
    wait();
    return *state_->value;
  }

  // The error of a completed future, or nullptr.
  std::exception_ptr error() const {
    absl::MutexLock lock(&state_->mu);
    return state_->done ? state_->error : nullptr;
  }

  // The error's message ("" without an error).
  std::string error_message() const {
    std::exception_ptr e = error();
    if (!e) return "";
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      return ex.what();
    } catch (...) {
      return "unknown exception";
    }
  }

  template <typename U = T, typename = std::enable_if_t<!std::is_void_v<U>>>
  void set_result(U value) const {
    complete(std::optional<stored_type>(std::move(value)), nullptr);
  }
  template <typename U = T, typename = std::enable_if_t<std::is_void_v<U>>>
  void set_result() const {
    complete(std::optional<stored_type>(std::monostate{}), nullptr);
  }
  // As set_result(), but does nothing and returns false when the future has
  // completed already (for outcomes that may be learned from two sources).
  template <typename U = T, typename = std::enable_if_t<std::is_void_v<U>>>
  bool try_set_result() const {
    return complete(std::optional<stored_type>(std::monostate{}), nullptr, /*once=*/false);
  }
  void set_error(std::exception_ptr error) const {
    complete(std::nullopt, std::move(error));
  }
  // As set_error(), but does nothing and returns false when already completed.
  bool try_set_error(std::exception_ptr error) const {
    return complete(std::nullopt, std::move(error), /*once=*/false);
  }
  void set_error(const RpcError& error) const {
    set_error(std::make_exception_ptr(error));
  }

  // Installs what wait() runs before it sleeps (see internal::FutureDriver);
  // futures chained with then() inherit it. Ignored once completed.
  void set_driver(std::shared_ptr<const internal::FutureDriver> driver) const {
    absl::MutexLock lock(&state_->mu);
    if (!state_->done) state_->driver = std::move(driver);
  }
  std::shared_ptr<const internal::FutureDriver> driver() const {
    absl::MutexLock lock(&state_->mu);
    return state_->driver;
  }

  // Runs `callback(*this)` once the future completes, after the callbacks
  // added before it (on the completing thread, or at once on this one when
  // that thread is done with them).
  void add_done_callback(std::function<void(const Future<T>&)> callback) const {
    {
      absl::MutexLock lock(&state_->mu);
      if (!state_->done || (state_->running_callbacks &&
                            state_->completing_thread != std::this_thread::get_id())) {
        state_->callbacks.push_back(std::move(callback));
        return;
      }
    }
    run_callback(callback);
  }

  // Chains `fn(const Future<T>&)`: the returned future completes with fn's
  // result, or with the exception fn throws. When fn returns a Future<U>,
  // the result is that future's outcome (a Future<U>, not Future<Future<U>>).
  template <typename F>
  auto then(F fn) const {
    using R = std::invoke_result_t<F, const Future<T>&>;
    if constexpr (internal::IsFuture<R>::value) {
      using U = typename R::value_type;
      Future<U> out;
      out.set_driver(driver());
      add_done_callback([fn = std::move(fn), out](const Future<T>& f) mutable {
        try {
          R inner = fn(f);
          inner.add_done_callback(
              [out](const R& g) mutable { g.forward_to(out); });
        } catch (...) {
          out.set_error(std::current_exception());
        }
      });
      return out;
    } else {
      Future<R> out;
      out.set_driver(driver());
      add_done_callback([fn = std::move(fn), out](const Future<T>& f) mutable {
        try {
          if constexpr (std::is_void_v<R>) {
            fn(f);
            out.set_result();
          } else {
            out.set_result(fn(f));
          }
        } catch (...) {
          out.set_error(std::current_exception());
        }
      });
      return out;
    }
  }

  // Completes `out` with this (completed) future's outcome.
  void forward_to(const Future<T>& out) const {
    if (state_->error) {
      out.set_error(state_->error);
    } else if constexpr (std::is_void_v<T>) {
      out.set_result();
    } else {
      out.set_result(*state_->value);
    }
  }

 private:
  using State = internal::FutureState<T>;

  // True once completed; false if `until` passed first.
  bool wait_done(absl::Time until) const {
    {
      absl::MutexLock lock(&state_->mu);
      if (state_->done) return true;
    }
    // About to wait: held work first (it may be what completes this future).
    internal::run_held_work();
    std::shared_ptr<const internal::FutureDriver> driver;
    {
      absl::MutexLock lock(&state_->mu);
      if (state_->done) return true;
      driver = state_->driver;
    }
    if (driver) {
      internal::run_driver(
          *driver,
          [state = state_.get()] {
            absl::MutexLock lock(&state->mu);
            return state->done;
          },
          until);
    }
    absl::MutexLock lock(&state_->mu);
    return state_->mu.AwaitWithDeadline(absl::Condition(&state_->done), until);
  }

  // With `once`, completing twice is a logic error; without, the second
  // completion is ignored. Returns whether this call completed the future.
  bool complete(std::optional<stored_type> value, std::exception_ptr error,
                bool once = true) const {
    std::vector<typename State::Callback> callbacks;
    std::shared_ptr<const internal::FutureDriver> driver;  // released after the lock
    {
      absl::MutexLock lock(&state_->mu);
      if (state_->done) {
        if (!once) return false;
        throw std::logic_error("rpc::Future completed twice");
      }
      state_->value = std::move(value);
      state_->error = std::move(error);
      state_->done = true;
      callbacks.swap(state_->callbacks);
      driver.swap(state_->driver);
      state_->running_callbacks = true;
      state_->completing_thread = std::this_thread::get_id();
    }
    // Callbacks in the order they were added, including those that other
    // threads add while these run.
    for (;;) {
      for (auto& cb : callbacks) run_callback(cb);
      callbacks.clear();
      absl::MutexLock lock(&state_->mu);
      if (state_->callbacks.empty()) {
        state_->running_callbacks = false;
        break;
      }
      callbacks.swap(state_->callbacks);
    }
    return true;
  }

  void run_callback(const std::function<void(const Future<T>&)>& callback) const noexcept {
    try {
      callback(*this);
    } catch (...) {
      internal::report_callback_error(std::current_exception());
    }
  }

  std::shared_ptr<State> state_;
};

// A future that is already completed with `value`.
template <typename T>
Future<T> make_ready_future(T value) {
  Future<T> f;
  f.set_result(std::move(value));
  return f;
}

// Completes when every future has completed (with a value or an error), like
// torch.futures.collect_all; the result holds the input futures.
template <typename T>
Future<std::vector<Future<T>>> collect_all(std::vector<Future<T>> futures) {
  Future<std::vector<Future<T>>> out;
  if (futures.empty()) {
    out.set_result({});
    return out;
  }
  // Waiting on the result reads replies like waiting on an input would (the
  // inputs' drivers all read the same process-wide queue).
  for (const auto& f : futures) {
    if (auto driver = f.driver()) {
      out.set_driver(std::move(driver));
      break;
    }
  }
  auto remaining = std::make_shared<std::atomic<size_t>>(futures.size());
  auto all = std::make_shared<std::vector<Future<T>>>(futures);
  for (const auto& f : futures) {
    f.add_done_callback([remaining, all, out](const Future<T>&) mutable {
      if (remaining->fetch_sub(1) == 1) out.set_result(std::move(*all));
    });
  }
  return out;
}

// Returns the futures' values in order once every one has completed, or
// throws the first error as soon as one fails, without waiting for the
// others (like torch.futures.wait_all): a fan-out with a failed call ends
// at once even while another call is still running.
template <typename T>
std::vector<typename Future<T>::stored_type> wait_all(
    const std::vector<Future<T>>& futures) {
  Future<void> done;
  for (const auto& f : futures) {
    if (auto driver = f.driver()) {
      done.set_driver(std::move(driver));  // waiting reads replies, as on an input
      break;
    }
  }
  auto remaining = std::make_shared<std::atomic<size_t>>(futures.size() + 1);
  auto one_done = [done, remaining](const Future<T>& f) {
    if (std::exception_ptr error = f.error()) {
      done.try_set_error(error);
    } else if (remaining->fetch_sub(1) == 1) {
      done.try_set_result();
    }
  };
  for (const auto& f : futures) f.add_done_callback(one_done);
  if (remaining->fetch_sub(1) == 1) done.try_set_result();  // all were complete already
  done.wait();  // rethrows the first error
  std::vector<typename Future<T>::stored_type> values;
  values.reserve(futures.size());
  for (const auto& f : futures) values.push_back(f.value());
  return values;
}

}  // namespace ddprpc::rpc
