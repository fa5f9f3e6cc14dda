#!/usr/bin/env bash
# On the build machine (Debian, ./bazelw's packages installed): lays out
# tools/gpu_check/carry/ for a GPU machine that has PyTorch with CUDA, NCCL,
# nvcc, g++ and CMake but no Bazel, no gRPC and no network:
#   sources.txt  the repository's sources gpu_check is built from (Bazel's
#                own list, so the CMake build cannot drift from the BUILD files)
#   gen/         what Bazel generates for them (protobuf and gRPC code)
#   include/     Debian's headers they include (abseil, gRPC, protobuf, ...)
#   lib/         Debian's shared libraries they link, dereferenced
# carry/ is ignored by git; copy it along with the tree (the device tool:
# carry=["tools/gpu_check/carry"]), then run run.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
./bazelw build //tools/gpu_check:gpu_check >/dev/null
carry=tools/gpu_check/carry
rm -rf "$carry" && mkdir -p "$carry/gen" "$carry/include" "$carry/lib"
bin=$(./bazelw info bazel-bin 2>/dev/null)

# Labels of gpu_check's sources and generated files in this repository
# (//pkg:file -> pkg/file). cquery, unlike query, sees the build's options
# (the libtorch of .venv).
labels() {
  ./bazelw cquery "kind('$1', deps(//tools/gpu_check:gpu_check))" --output=label 2>/dev/null |
    grep '^//' | cut -d' ' -f1 | sed -e 's|^//||' -e 's|:|/|' -e 's|^/||'
}
: >"$carry/sources.txt"
for f in $(labels 'source file'); do
  case $f in *.cc) echo "$f" >>"$carry/sources.txt" ;; esac
done
for f in $(labels 'generated file'); do
  case $f in
    *.pb.h | *.pb.cc)
      mkdir -p "$carry/gen/$(dirname "$f")"
      cp "$bin/$f" "$carry/gen/$f"
      case $f in *.cc) echo "$carry/gen/$f" >>"$carry/sources.txt" ;; esac
      ;;
  esac
done

# Debian's headers that the build included, by top-level directory.
find "$bin" -path '*/_objs/*' -name '*.d' -print0 | xargs -0 cat | tr ' \\' '\n\n' |
  sed -n 's|^/usr/include/||p' | grep -v '^c++/' | sort -u >"$carry/headers.txt"
for top in $(cut -d/ -f1 "$carry/headers.txt" | sort -u); do
  case $top in
    *.h) ;;  # the C library's own
    x86_64-linux-gnu)
      for sub in $(sed -n 's|^x86_64-linux-gnu/\([^/]*\)/.*|\1|p' "$carry/headers.txt" | sort -u); do
        case $sub in openssl) mkdir -p "$carry/include/x86_64-linux-gnu" &&
          cp -r "/usr/include/x86_64-linux-gnu/$sub" "$carry/include/x86_64-linux-gnu/" ;; esac
      done
      ;;
    absl | grpc | grpc++ | grpcpp | google | openssl | glog | gflags | re2 | upb | gperftools)
      cp -r "/usr/include/$top" "$carry/include/"
      ;;
  esac
done
# protobuf's headers only, not all of /usr/include/google.
if [ -d "$carry/include/google" ]; then
  find "$carry/include/google" -mindepth 1 -maxdepth 1 ! -name protobuf -exec rm -rf {} +
fi

# Debian's shared libraries the Bazel-built binary loads, except the C and
# C++ runtimes (the GPU machine's own, newer ones serve).
ldd "$bin/tools/gpu_check/gpu_check" |
  awk '$2 == "=>" && $3 ~ /^\/(usr\/)?lib\/x86_64-linux-gnu\// {print $3}' |
  grep -vE '/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so' |
  while read -r lib; do cp -L "$lib" "$carry/lib/"; done

echo "$(wc -l <"$carry/sources.txt") sources, $(ls "$carry/lib" | wc -l) libraries; $(du -sh "$carry" | cut -f1) in $carry"
