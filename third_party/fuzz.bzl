"""cc_fuzzer: a libFuzzer target built with Debian's clang (-fsanitize=fuzzer,address,undefined).

The rest of the build uses gcc, which has no libFuzzer. A cc_fuzzer compiles
its `srcs` (the fuzz target and the code under test, for coverage feedback
and sanitizer checks) with clang, and links them against the gcc-built
libraries of `deps`, except those named in `instrumented`, whose sources
must be among `srcs` instead.

    cc_fuzzer(
        name = "frame_fuzzer",
        srcs = ["fuzz/frame_fuzzer.cc", "internal/codec.cc"],
        instrumented = [":codec"],
        deps = [":codec"],
        corpus = glob(["fuzz/corpus/frames/*"]),
    )

gives `bazel run //rpc:frame_fuzzer -- -max_total_time=600` (the checked-in
corpus is read, new inputs go to a scratch directory) and the test
`frame_fuzzer_smoke`, which fuzzes for `smoke_seconds` and fails on any
crash, leak or timeout.
"""

load("//third_party:copts.bzl", "DDPRPC_COPTS")

_CLANG = "clang++-14"

_COPTS = DDPRPC_COPTS + [
    "-O1",
    "-gline-tables-only",
    "-fno-omit-frame-pointer",
    "-fsanitize=fuzzer-no-link,address,undefined",
    "-fno-sanitize-recover=undefined",
    "-Wno-deprecated-declarations",
    "-Wno-unused-command-line-argument",
]
_LINKOPTS = ["-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=undefined"]

def _fuzzer_binary_impl(ctx):
    merged = cc_common.merge_cc_infos(cc_infos = [d[CcInfo] for d in ctx.attr.deps])
    comp = merged.compilation_context
    include_flags = ["-iquote", ".", "-iquote", ctx.bin_dir.path, "-iquote", ctx.genfiles_dir.path]
    for d in comp.quote_includes.to_list():
        include_flags += ["-iquote", d]
    for d in comp.includes.to_list():
        include_flags += ["-I", d]
    for d in comp.system_includes.to_list():
        include_flags += ["-isystem", d]
    define_flags = ["-D" + d for d in comp.defines.to_list()]

    objects = []
    for src in ctx.files.srcs:
        obj = ctx.actions.declare_file("_objs/%s/%s.o" % (ctx.label.name, src.path.replace("/", "_")))
        ctx.actions.run(
            executable = _CLANG,
            arguments = _COPTS + define_flags + include_flags + ["-c", src.path, "-o", obj.path],
            inputs = depset([src], transitive = [comp.headers]),
            outputs = [obj],
            mnemonic = "FuzzCompile",
            progress_message = "Compiling %s for fuzzing" % src.short_path,
            use_default_shell_env = True,
        )
        objects.append(obj)

    skip = [str(l.label) for l in ctx.attr.instrumented]
    libs = []
    link_flags = []
    lib_inputs = []
    for linker_input in merged.linking_context.linker_inputs.to_list():
        if str(linker_input.owner) in skip:
            continue
        link_flags += linker_input.user_link_flags
        lib_inputs += linker_input.additional_inputs
        for lib in linker_input.libraries:
            # The archives the tests and binaries link (non-PIC objects in
            # an optimized build), so that no library is compiled twice.
            archive = lib.static_library or lib.pic_static_library
            if archive:
                lib_inputs.append(archive)
                if lib.alwayslink:
                    libs += ["-Wl,--whole-archive", archive.path, "-Wl,--no-whole-archive"]
                else:
                    libs.append(archive.path)
            elif lib.dynamic_library:
                lib_inputs.append(lib.dynamic_library)
                libs.append(lib.dynamic_library.path)

    out = ctx.actions.declare_file(ctx.label.name)
    ctx.actions.run(
        executable = _CLANG,
        # Instrumented objects first: archive members defining the same
        # symbols are then never pulled in.
        arguments = _LINKOPTS + [o.path for o in objects] + ["-Wl,--start-group"] + libs +
                    ["-Wl,--end-group"] + link_flags + ["-lstdc++", "-lm", "-o", out.path],
        inputs = depset(objects + lib_inputs),
        outputs = [out],
        mnemonic = "FuzzLink",
        progress_message = "Linking fuzzer %s" % ctx.label,
        use_default_shell_env = True,
    )
    return [DefaultInfo(executable = out, runfiles = ctx.runfiles(files = ctx.files.data))]

_fuzzer_binary = rule(
    implementation = _fuzzer_binary_impl,
    executable = True,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cc"]),
        "deps": attr.label_list(providers = [CcInfo]),
        "instrumented": attr.label_list(providers = [CcInfo]),
        "data": attr.label_list(allow_files = True),
    },
)

def cc_fuzzer(name, srcs, deps, corpus, instrumented = [], smoke_seconds = 20, tags = ["fuzz"]):
    _fuzzer_binary(
        name = name + "_bin",
        srcs = srcs,
        deps = deps,
        instrumented = instrumented,
        data = corpus,
        tags = ["manual"],
    )

    # `bazel run :name`: fuzzes with the checked-in corpus as seeds.
    native.sh_binary(
        name = name,
        srcs = ["//third_party:run_fuzzer.sh"],
        args = ["$(rootpath :%s_bin)" % name, "0", "$(rootpath %s)" % corpus[0]],
        data = [":" + name + "_bin"] + corpus,
        tags = tags,
    )
    native.sh_test(
        name = name + "_smoke",
        size = "medium",
        srcs = ["//third_party:run_fuzzer.sh"],
        args = ["$(rootpath :%s_bin)" % name, str(smoke_seconds), "$(rootpath %s)" % corpus[0]],
        data = [":" + name + "_bin"] + corpus,
        tags = tags,
    )
