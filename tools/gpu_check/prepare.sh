#!/usr/bin/env bash
# On the build machine (Debian, ./bazelw's packages installed): lays out
# tools/gpu_check/carry/absl (Debian's abseil headers and shared libraries),
# which the GPU machine lacks. carry/ is ignored by git; copy it along with
# the tree (the device tool: carry=["tools/gpu_check/carry"]).
set -euo pipefail
cd "$(dirname "$0")"
rm -rf carry && mkdir -p carry/absl/include carry/absl/lib
cp -r /usr/include/absl carry/absl/include/
for f in /usr/lib/x86_64-linux-gnu/libabsl_*.so.*; do
  cp -L "$f" carry/absl/lib/
done
# Unversioned names for the linker.
for f in carry/absl/lib/libabsl_*.so.*; do
  ln -sf "$(basename "$f")" "${f%%.so.*}.so"
done
du -sh carry
