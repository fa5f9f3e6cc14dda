#!/usr/bin/env bash
# Runs gpu_check: on a machine with a GPU and NCCL every check must pass; on
# one without, it must say that it skipped and why. Then its checks on the
# CPU (--cpu, over a Gloo group), which must all pass anywhere.
set -u
out=$(tools/gpu_check/gpu_check 2>&1); rc=$?
echo "$out"
if grep -q '^gpu_check: SKIP: ' <<<"$out"; then
  [ "$rc" -eq 0 ] || { echo "skipped but exited $rc"; exit 1; }
else
  grep -qE '^gpu_check: [0-9]+ passed, 0 failed$' <<<"$out" && [ "$rc" -eq 0 ] || exit 1
fi
out=$(tools/gpu_check/gpu_check --cpu 2>&1); rc=$?
echo "$out"
grep -qE '^gpu_check: [0-9]+ passed, 0 failed$' <<<"$out" && [ "$rc" -eq 0 ]
