#!/usr/bin/env bash
# Charts an rpc_rl JSON report as a PNG (four metrics against the x axis,
# ddprpc and PyTorch side by side) with Debian's python3-matplotlib.
#   ./bazelw run //benchmarks:plot -- benchmark_report.json [chart.png]
set -euo pipefail
here="${BASH_SOURCE[0]%/*}"
script="$here/reference/plot_rl.py"
[ -f "$script" ] || script="${RUNFILES_DIR:-$0.runfiles}/ddprpc/benchmarks/reference/plot_rl.py"
cd "${BUILD_WORKING_DIRECTORY:-.}"
exec /usr/bin/python3 "$script" "$@"
