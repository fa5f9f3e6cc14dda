// The streams a server has admitted, by the worker each proved it speaks
// for; both transports' servers keep one. A worker has at most
// `max_per_worker` streams (ServerLimits::max_streams_per_worker). The
// newest proven stream of a worker wins: at the limit its oldest gives way,
// so streams left behind (a worker that restarted, or another holder of the
// job's token writing in its name) cannot keep the worker out.
//
// Not thread-safe: a server calls it under its own lock. `Stream` is a
// handle the server can compare and end (a shared_ptr to its stream).
#pragma once

#include <algorithm>
#include <deque>
#include <utility>
#include <vector>

namespace ddprpc::rpc::internal {

template <typename Stream>
class CallerTable {
 public:
  // Workers [0, world_size); at least one stream each.
  CallerTable(int world_size, int max_per_worker)
      : by_worker_(std::max(world_size, 1)), max_per_worker_(std::max(max_per_worker, 1)) {}

  // Counts `stream` for `worker`, which the caller checked is in
  // [0, world_size). Returns the stream that gave way for it (no longer
  // counted; the server ends it), or a null handle when none had to.
  Stream admit(int worker, Stream stream) {
    std::deque<Stream>& streams = by_worker_[worker];
    Stream replaced{};
    if (static_cast<int>(streams.size()) >= max_per_worker_) {
      replaced = std::move(streams.front());
      streams.pop_front();
    }
    streams.push_back(std::move(stream));
    return replaced;
  }

  // Stops counting `stream` for `worker`; false when it was not counted
  // (it gave way, or was never admitted).
  bool release(int worker, const Stream& stream) {
    if (worker < 0 || worker >= static_cast<int>(by_worker_.size())) return false;
    std::deque<Stream>& streams = by_worker_[worker];
    auto it = std::find(streams.begin(), streams.end(), stream);
    if (it == streams.end()) return false;
    streams.erase(it);
    return true;
  }

  // Streams counted for `worker`.
  int count(int worker) const { return static_cast<int>(by_worker_[worker].size()); }

 private:
  std::vector<std::deque<Stream>> by_worker_;  // each oldest first
  const int max_per_worker_;
};

}  // namespace ddprpc::rpc::internal
