#!/usr/bin/env bash
# benchmarks/gpu_bench.sh [OUT_DIR]: the transfer benchmark's GPU run (issue 12), kept under its old name.
# It is `benchmarks/gpu_check.sh --part bench` (VRAM smoke test, then W1 + W2 against raw NIXL at
# Llama-3.1-8B geometry, falling back to DRAM and saying so); W3 fan-in is in `--part qualify`.
# See docs/operations.md, "GPU check".
set -uo pipefail
export OUT="${1:-${OUT:-gpu-bench-out}}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu_check.sh" --part bench
