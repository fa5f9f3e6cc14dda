#!/usr/bin/env bash
# Builds and runs the consumer example in its own workspace and output base,
# as another project would use ddprpc. Exits non-zero if it fails.
#   examples/consumer/run.sh
# The libtorch is that of DDPRPC_PYTHON's PyTorch (default: ddprpc's .venv,
# which ../../bazelw sets up); DDPRPC_LIBTORCH names a libtorch tree instead.
set -euo pipefail
cd "$(dirname "$0")"
root=$(cd ../.. && pwd)
output_base=${CONSUMER_OUTPUT_BASE:-${HOME:-/tmp}/.cache/ddprpc-consumer}
libtorch=(--repo_env=DDPRPC_PYTHON="${DDPRPC_PYTHON:-$root/.venv/bin/python3}")
[ -z "${DDPRPC_LIBTORCH:-}" ] || libtorch=(--repo_env=DDPRPC_LIBTORCH="$DDPRPC_LIBTORCH")
# ../../bazelw installs the Debian packages and ddprpc's .venv when missing,
# then runs Bazel.
../../bazelw --output_base="$output_base" run --symlink_prefix=/ "${libtorch[@]}" //:train
