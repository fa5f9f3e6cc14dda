// The identity of a remote reference as every worker holding one sees it:
// its id, the fork a handle stands for, its owner and its type. Shared by
// the copies of one rpc::RRef<T> (rref.h); the bookkeeping behind it is
// internal/rref_context.h.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "rpc/core/future.h"

namespace ddprpc::rpc::internal {

class RRefContext;

struct RRefId {
  int32_t worker = -1;
  int64_t local = 0;
  bool valid() const { return worker >= 0; }
  bool operator==(const RRefId& o) const { return worker == o.worker && local == o.local; }
  template <typename H>
  friend H AbslHashValue(H h, const RRefId& id) {
    return H::combine(std::move(h), id.worker, id.local);
  }
};

// The identity of one RRef handle. Copies of an RRef<T> share one state;
// destroying it releases the handle's fork at the owner.
struct RRefState {
  RRefId id;
  RRefId fork;  // invalid for the owner's own (local) handles
  int owner = -1;
  std::string type;      // registered class name, or "" for a value
  Future<void> created;  // completes when the owner confirmed creation
  std::weak_ptr<RRefContext> context;
  ~RRefState();
};

// How an RRef travels inside a c10::IValue (as a capsule).
class RRefCapsule : public torch::CustomClassHolder {
 public:
  explicit RRefCapsule(std::shared_ptr<RRefState> state) : state(std::move(state)) {}
  std::shared_ptr<RRefState> state;
};

}  // namespace ddprpc::rpc::internal
