#!/usr/bin/env bash
# Runs a cc_fuzzer (see fuzz.bzl):
#   run_fuzzer.sh FUZZER SECONDS SEED_FILE [libFuzzer flags ...]
# The seeds are the files beside SEED_FILE (read only); inputs the fuzzer
# finds go to a scratch corpus ($FUZZ_CORPUS_DIR, or a new temporary
# directory). SECONDS > 0 bounds the run (a smoke test); 0 leaves it to the
# flags (e.g. -max_total_time=600). Exits non-zero on a crash, a leak or a
# timeout, with the input that caused it saved and named.
set -euo pipefail
fuzzer=$1
seconds=$2
seeds=$(dirname "$3")
shift 3
work=${FUZZ_CORPUS_DIR:-${TEST_TMPDIR:-$(mktemp -d)}/corpus}
mkdir -p "$work"
artifacts=${TEST_UNDECLARED_OUTPUTS_DIR:-$work}
flags=(-timeout=10 -rss_limit_mb=4096 -print_final_stats=1 "-artifact_prefix=$artifacts/")
if [ "$seconds" -gt 0 ]; then flags+=("-max_total_time=$seconds"); fi
echo "fuzzing with seeds from $seeds; new inputs go to $work" >&2
exec "$fuzzer" "${flags[@]}" "$@" "$work" "$seeds"
