#!/usr/bin/env bash
# Runs tests/fault_matrix.py on the ddp_rpc binary (needs root: ip netns).
set -euo pipefail
exec /usr/bin/python3 "$1" "$2" --rpc_timeout_s=20
