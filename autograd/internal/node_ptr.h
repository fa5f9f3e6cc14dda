// Owning pointers to autograd nodes across libtorch versions.
//
// libtorch 2.13 owns autograd nodes through c10::intrusive_ptr (Node is an
// intrusive_ptr_target); earlier releases through std::shared_ptr (Node is
// enable_shared_from_this). NodePtr is whichever Edge::function is, and the
// two helpers below make and recover such pointers without naming either.
#pragma once

#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace ddprpc::dist_autograd::internal {

using NodePtr = decltype(torch::autograd::Edge::function);

inline constexpr bool kIntrusiveNodes =
    !std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>;

template <typename T>
using NodePtrOf = std::conditional_t<kIntrusiveNodes, c10::intrusive_ptr<T>, std::shared_ptr<T>>;

// A new node of type T, owned as libtorch owns nodes.
template <typename T, typename... Args>
NodePtrOf<T> make_node(Args&&... args) {
  if constexpr (kIntrusiveNodes) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<T>(std::forward<Args>(args)...);
  }
}

// A new owning pointer to a node that something else owns already (the
// graph reached it through an edge).
template <typename T>
NodePtrOf<T> node_ptr(T* node) {
  if constexpr (kIntrusiveNodes) {
    return c10::intrusive_ptr<T>::unsafe_reclaim_from_nonowning(node);
  } else {
    return std::static_pointer_cast<T>(node->shared_from_this());
  }
}

}  // namespace ddprpc::dist_autograd::internal
