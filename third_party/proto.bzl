"""cc_grpc_library: compiles a .proto with the system protoc and grpc_cpp_plugin.

Produces a cc_library named `name` with the message classes (.pb.h/.pb.cc)
and, when grpc = True, the service stubs (.grpc.pb.h/.grpc.pb.cc). Works in
the main repository and when ddprpc is an external repository of another
workspace (sources under external/<name>/, outputs under $(GENDIR)/external/<name>/).
"""

load("//third_party:copts.bzl", "DDPRPC_COPTS")

def cc_grpc_library(name, src, grpc = True, deps = [], visibility = None):
    base = src[:-len(".proto")]
    pkg = native.package_name()
    repo = native.repository_name()  # "@" in the main repository
    root = "external/" + repo[1:] if repo != "@" else "."
    out_root = "$(GENDIR)/" + root if repo != "@" else "$(GENDIR)"
    outs = [base + ".pb.h", base + ".pb.cc"]
    cmd = "protoc -I%s --cpp_out=%s " % (root, out_root)
    if grpc:
        outs += [base + ".grpc.pb.h", base + ".grpc.pb.cc"]
        cmd += "--grpc_out=%s --plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin) " % out_root
    native.genrule(
        name = name + "_codegen",
        srcs = [src],
        outs = outs,
        cmd = cmd + root + "/" + (pkg + "/" if pkg else "") + src,
    )
    native.cc_library(
        name = name,
        copts = DDPRPC_COPTS,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + ["//third_party:protobuf"] + (["//third_party:grpc"] if grpc else []),
        visibility = visibility,
    )
