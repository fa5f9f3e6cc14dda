"""The compiler flags every C++ target of ddprpc carries, so that a workspace
using ddprpc's targets needs no flags of its own for them.

libtorch 2.14 and later need C++20; 2.13's headers build with C++17 (and with
C++20). A consumer's own targets that include ddprpc's or libtorch's headers
take the same flags:

    load("@ddprpc//third_party:copts.bzl", "DDPRPC_COPTS")
    cc_binary(name = "train", srcs = ["train.cc"], copts = DDPRPC_COPTS, ...)
"""

load("@libtorch//:defs.bzl", "LIBTORCH_VERSION")

def cxx_std(version):
    """The -std flag libtorch `version` ("2.13.0") needs."""
    parts = version.split(".")
    if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
        if (int(parts[0]), int(parts[1])) >= (2, 14):
            return "-std=c++20"
    return "-std=c++17"

DDPRPC_COPTS = [cxx_std(LIBTORCH_VERSION)]
