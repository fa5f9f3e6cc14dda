"""System (Debian) dependencies of ddprpc.

A workspace that depends on @ddprpc calls ddprpc_system_deps() from its
WORKSPACE too, so libtorch and CUDA resolve the same way.

libtorch is Debian's (libtorch-dev) unless the environment variable
DDPRPC_LIBTORCH names another libtorch tree (include/ and lib/, as in
pytorch.org's cxx11-ABI zip), e.g. a CUDA build:
    ./bazelw build --repo_env=DDPRPC_LIBTORCH=/opt/libtorch //...
"""

_SYSTEM_TORCH = """
# Debian's libtorch: ATen/c10 headers in /usr/include (searched already), the
# C++ frontend (torch/nn, torch/optim, ...) under api/.
cc_library(
    name = "torch",
    hdrs = glob(["api/torch/**/*.h"]),
    includes = ["api"],
    defines = ["C10_USE_GLOG"],
    linkopts = ["-ltorch", "-ltorch_cpu", "-lc10", "-lpthread"],
    visibility = ["//visibility:public"],
)
"""

_TREE_TORCH = """
# libtorch from {root}{cuda_note}.
cc_library(
    name = "torch",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh"]),
    includes = ["include", "include/torch/csrc/api/include"],
    defines = {defines},
    linkopts = [
        "-L{root}/lib",
        "-Wl,-rpath,{root}/lib",
        # Kernels register themselves at load: keep every library linked.
        "-Wl,--no-as-needed",
    ] + {libs} + ["-Wl,--as-needed", "-lpthread"],
    visibility = ["//visibility:public"],
)
"""

def _libtorch_impl(ctx):
    root = ctx.os.environ.get("DDPRPC_LIBTORCH", "")
    if not root:
        ctx.symlink("/usr/include/torch/csrc/api/include", "api")
        ctx.file("BUILD.bazel", _SYSTEM_TORCH)
        ctx.file("defs.bzl", "LIBTORCH = \"system\"\nLIBTORCH_CUDA = False\n")
        return
    for need in ["include/torch/csrc/api/include/torch/torch.h", "include/ATen/ATen.h", "lib/libtorch.so", "lib/libc10.so"]:
        if not ctx.path(root + "/" + need).exists:
            fail("DDPRPC_LIBTORCH=%s is not a libtorch tree: %s/%s is missing" % (root, root, need))
    ctx.symlink(root + "/include", "include")
    libs = ["-ltorch", "-ltorch_cpu", "-lc10"]
    cuda = ctx.path(root + "/lib/libtorch_cuda.so").exists
    defines = []
    if cuda:
        libs += ["-ltorch_cuda", "-lc10_cuda"]
        defines.append("DDPRPC_LIBTORCH_CUDA=1")
    ctx.file("BUILD.bazel", _TREE_TORCH.format(
        root = root,
        cuda_note = " (with CUDA)" if cuda else "",
        defines = repr(defines),
        libs = repr(libs),
    ))
    ctx.file("defs.bzl", "LIBTORCH = %r\nLIBTORCH_CUDA = %s\n" % (root, cuda))

# libtorch: Debian's, or the tree named by DDPRPC_LIBTORCH.
_libtorch = repository_rule(
    implementation = _libtorch_impl,
    environ = ["DDPRPC_LIBTORCH"],
    local = True,
)

def ddprpc_system_deps():
    _libtorch(name = "libtorch")

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
