#!/usr/bin/env bash
# On a GPU machine with PyTorch (CUDA), NCCL, nvcc, g++ and CMake, but no
# Bazel and no network: builds gpu_check with CMake against that PyTorch's
# libtorch, NCCL and CUDA, runs it, and prints PyTorch's own NCCL allreduce
# beside it. Needs carry/ from prepare.sh. Prints gpu_check's CHECK lines
# and its "gpu_check: P passed, F failed" line; exits with its status.
set -uo pipefail
cd "$(dirname "$0")"
here=$PWD
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
read -r torch abi cuda <<<"$($py -c 'import os, torch; print(os.path.dirname(torch.__file__), int(torch._C._GLIBCXX_USE_CXX11_ABI), torch.version.cuda)')"
nccl=$($py -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || echo /usr/local/cuda)
echo "torch $($py -c 'import torch; print(torch.__version__)') (cxx11 ABI $abi, CUDA $cuda), NCCL at $nccl"
[ -f carry/sources.txt ] || { echo "gpu_check: carry/ missing: run prepare.sh on the build machine"; exit 2; }
build=$(mktemp -d)
cmake -S . -B "$build" -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release -DTORCH_ROOT="$torch" -DTORCH_CXX11_ABI="$abi" \
  -DNCCL_ROOT="$nccl" >"$build/cmake.log" 2>&1 \
  || { tail -30 "$build/cmake.log"; exit 2; }
cmake --build "$build" -j "$(nproc)" -- -k >"$build/build.log" 2>&1 || { [ -n "${OUT:-}" ] && cp "$build/build.log" "$OUT/"; grep -E "error|undefined" "$build/build.log" | head -40; exit 2; }
# RUNPATH reaches only the program's own dependencies, not theirs.
export LD_LIBRARY_PATH="$here/carry/lib:$torch/lib:$nccl/lib:${LD_LIBRARY_PATH:-}"
timeout 600 "$build/gpu_check"; rc=$?
echo "gpu_check exit $rc"
timeout 120 $py - <<'PY' || true
import tempfile, time, torch, torch.distributed as dist
dist.init_process_group("nccl", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
t = torch.ones(16 << 20, device="cuda")
dist.all_reduce(t); torch.cuda.synchronize()
s = time.perf_counter()
for _ in range(10): dist.all_reduce(t)
torch.cuda.synchronize()
print(f"PyTorch NCCL, world size 1, 64 MiB allreduce: {(time.perf_counter() - s) * 100:.3f} ms per call")
dist.destroy_process_group()
PY
exit $rc
