"""``kvown inspect FILE...``: print flight-recorder dumps readably (the format: ``kvown.runtime.flight``)."""

from __future__ import annotations

import sys
import time
from typing import Any

from kvown.runtime.flight import read_flight_file


def _format(records: list[dict[str, Any]]) -> str:
    out: list[str] = []
    header = next((r for r in records if r.get("type") == "header"), None)
    if header is None:
        raise ValueError("no header line")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(header["wall_time_s"]))
    out.append(f"kvown flight recorder: rank {header['rank']} pid {header['pid']} at {when}")
    out.append(f"  reason: {header['reason']}  request: {header['request_id']}  {header['detail']}")
    events = [r for r in records if r.get("type") == "event"]
    out.append(f"  events: {len(events)} (ring capacity {header['capacity']}, dropped {header['dropped']})")
    for ev in events:
        ago_ms = (header["mono_ns"] - ev["t_ns"]) / 1e6
        rid = "-" if ev["request_id"] is None else ev["request_id"]
        det = " ".join(f"{k}={v}" for k, v in ev["detail"].items())
        out.append(f"  -{ago_ms:10.3f} ms  req {rid:<8} {ev['kind']:<20} {det}")
    for st in (r for r in records if r.get("type") == "stack"):
        out.append(f"  thread {st['thread_name']} (id {st['thread_id']}, daemon={st['daemon']}):")
        out.extend(f"      {frame}" for frame in st["frames"])
    return "\n".join(out) + "\n"


def inspect_main(argv: list[str] | None = None) -> int:
    """``kvown inspect FILE...``: print flight recorder dumps readably. Returns a process exit code.

    Called: by the CLI, once per invocation, main thread. After error: prints the problem to stderr
    and returns 2 (missing file, not a flight recorder dump).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: kvown inspect FILE [FILE...]", file=sys.stderr)
        return 2
    status = 0
    for path in args:
        try:
            sys.stdout.write(_format(read_flight_file(path)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"kvown inspect: {path}: not a readable flight recorder dump: {exc}", file=sys.stderr)
            status = 2
    return status
