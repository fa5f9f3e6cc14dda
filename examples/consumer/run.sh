#!/usr/bin/env bash
# Builds and runs the consumer example in its own workspace and output base,
# as another project would use ddprpc. Exits non-zero if it fails.
#   examples/consumer/run.sh
set -euo pipefail
cd "$(dirname "$0")"
output_base=${CONSUMER_OUTPUT_BASE:-${HOME:-/tmp}/.cache/ddprpc-consumer}
# ../../bazelw installs the Debian packages when missing, then runs Bazel.
../../bazelw --output_base="$output_base" run --symlink_prefix=/ //:train
