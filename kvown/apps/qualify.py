"""``kvown qualify``: run the ownership scenarios in a real 3-rank world and report each check.

Owns: the launcher and the verdict table. The world itself is ``kvown.apps.qualify_world``.

Use it to qualify a deployment: the hosts (``--hosts a,b,c`` places ranks on nodes), the KV layout
(``--layout nvfp4``) and the device (``--device cuda``) you will run. Exit code 0 only if every check
of every scenario passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from kvown.apps.launch import mpirun_command


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvown qualify", description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=["standard", "mla", "nvfp4"], default="standard")
    ap.add_argument("--device", default="cpu", help="cpu (host memory) or cuda (VRAM)")
    ap.add_argument("--hosts", help="comma-separated hosts for mpirun --host (multi-node)")
    ap.add_argument("--json", metavar="PATH", help="write {scenario: {check: bool}} as JSON")
    ap.add_argument("--timeout-s", type=float, default=240.0)
    args = ap.parse_args(argv)

    import subprocess

    out = os.path.join(tempfile.mkdtemp(prefix="kvown-qualify-"), "checks.json")
    cmd = mpirun_command(3)
    if args.hosts:
        cmd += ["--host", args.hosts]
    cmd += [sys.executable, "-m", "kvown.apps.qualify_world", "--layout", args.layout, "--device", args.device, out]
    print(f"kvown qualify: layout {args.layout}, device {args.device}, hosts {args.hosts or 'this one'}", flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s,
                              env=dict(os.environ, NIXL_LOG_LEVEL="WARN"))
    except subprocess.TimeoutExpired:
        print("kvown qualify: the world did not finish in time: FAIL", file=sys.stderr)
        return 1
    if proc.returncode != 0 or not os.path.exists(out):
        print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
        print(f"kvown qualify: the world failed (exit code {proc.returncode}): FAIL", file=sys.stderr)
        return 1
    with open(out) as f:
        checks = json.load(f)
    ok = True
    for name, results in checks.items():
        failed = [k for k, v in results.items() if not v]
        ok &= not failed
        print(f"  {'PASS' if not failed else 'FAIL'}  {name:<30} {len(results)} checks"
              + (f"  failed: {', '.join(failed)}" if failed else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(checks, f, indent=1)
    print("kvown qualify: " + ("every check passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
