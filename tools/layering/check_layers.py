"""Checks that Bazel dependencies between the project's packages run one way.

Reads `bazel query --output=xml` of the project's libraries and binaries
(the genquery beside this file) and fails when a rule that is not testonly
depends on a rule of a package in a higher layer, or when a package that
holds such a rule has no layer here. Tests and test helpers (testonly) may
reach any layer: a store test may start an RPC worker to talk to.

    check_layers.py QUERY_XML
"""
import sys
import xml.etree.ElementTree as ET

# Lowest first. Packages on one line share a layer and may use each other;
# a package may use any package of a lower layer.
LAYERS = [
    ["//rpc/core"],
    ["//rpc/rendezvous"],
    ["//rpc/wire"],
    ["//rpc/transport"],
    ["//rpc"],
    ["//rpc/rref", "//rpc/profiler"],
    ["//autograd"],
    ["//optim", "//ddp"],
    ["//elastic"],
    ["//models"],
    ["//benchmarks", "//benchmarks/testing", "//tools", "//tools/gpu_check", "//tests",
     "//examples"],
]


def layer_of(package):
    for i, packages in enumerate(LAYERS):
        if package in packages:
            return i
    return None


def package_of(label):
    return label.split(":", 1)[0]


def main(path):
    rules = ET.parse(path).getroot().findall("rule")
    problems = []
    checked = 0
    for rule in rules:
        name = rule.get("name")
        if not name.startswith("//"):
            continue  # external: libtorch, Debian's libraries, stand-ins
        package = package_of(name)
        if package.startswith("//third_party"):
            continue
        testonly = any(
            b.get("name") == "testonly" and b.get("value") == "true"
            for b in rule.findall("boolean"))
        if testonly:
            continue
        mine = layer_of(package)
        if mine is None:
            problems.append(f"{name}: package {package} is in no layer (tools/layering/check_layers.py)")
            continue
        for lst in rule.findall("list"):
            if lst.get("name") not in ("deps", "implementation_deps"):
                continue
            for dep in lst.findall("label"):
                target = dep.get("value")
                if not target.startswith("//"):
                    continue
                dep_package = package_of(target)
                if dep_package.startswith("//third_party"):
                    continue
                theirs = layer_of(dep_package)
                checked += 1
                if theirs is None:
                    problems.append(f"{name} -> {target}: package {dep_package} is in no layer")
                elif theirs > mine:
                    problems.append(
                        f"{name} -> {target}: {package} (layer {mine}) depends upward on "
                        f"{dep_package} (layer {theirs})")
    for p in problems:
        print(p)
    print(f"{checked} dependencies between the project's packages checked, "
          f"{len(problems)} running upward or unplaced")
    return 1 if problems or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
