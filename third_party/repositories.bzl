"""System (Debian) dependencies of ddprpc.

A workspace that depends on @ddprpc calls ddprpc_system_deps() from its
WORKSPACE too, so the libtorch C++ API headers resolve the same way.
"""

def ddprpc_system_deps():
    # libtorch's C++ frontend headers live under a non-standard include root;
    # exposing them as a repository lets cc_library propagate the include path.
    native.new_local_repository(
        name = "libtorch_api",
        path = "/usr/include/torch/csrc/api/include",
        build_file_content = """
cc_library(
    name = "headers",
    hdrs = glob(["torch/**/*.h"]),
    includes = ["."],
    visibility = ["//visibility:public"],
)
""",
    )

    _local_cuda(name = "local_cuda")

def _local_cuda_impl(ctx):
    cuda = ctx.path("/usr/local/cuda")
    has_nccl = cuda.get_child("include").get_child("nccl.h").exists
    if has_nccl:
        ctx.symlink("/usr/local/cuda/include", "include")
        build = """
cc_library(
    name = "nccl",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp"]),
    includes = ["include"],
    defines = ["DDPRPC_WITH_NCCL=1"],
    linkopts = [
        "-L/usr/local/cuda/lib64",
        "-Wl,-rpath,/usr/local/cuda/lib64",
        "-lnccl",
        "-lcudart",
    ],
    visibility = ["//visibility:public"],
)
"""
    else:
        build = """
cc_library(
    name = "nccl",
    visibility = ["//visibility:public"],
)
"""
    ctx.file("BUILD.bazel", build)
    ctx.file("defs.bzl", "HAS_NCCL = %s\n" % has_nccl)

# CUDA runtime + NCCL from /usr/local/cuda when it is installed; an empty
# library (and HAS_NCCL = False) otherwise.
_local_cuda = repository_rule(
    implementation = _local_cuda_impl,
    local = True,
)
