// The rendezvous store gpu_check's group meets in: the real one
// (bazel_store.cc) under Bazel, a directory of files (file_store.cc) in the
// CMake build of a GPU machine without gRPC.
#pragma once

#include <memory>

#include "rpc/rendezvous/store.h"

namespace gpu_check {

std::shared_ptr<ddprpc::rpc::Store> make_store();

}  // namespace gpu_check
