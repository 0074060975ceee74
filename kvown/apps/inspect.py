"""``kvown inspect FILE...``: read a flight-recorder dump as a post-mortem (format: ``kvown.runtime.flight``).

Owns: the report. It opens with why the rank stopped and what was open at the dump - each open
session, its writers, the proof still missing, how long it had been open and how long since its last
event - then the events oldest to newest, then the threads' stacks. ``--json`` prints the summary for
machines. ``--hops`` reads the dumps of several ranks together: where sessions' time went
(``kvown.apps.hops``).

Rules:
  1. The summary comes from the dump's ``open_session`` lines (the cores' own state at the dump). A
     dump without them (an old format, or a recorder with no state source) gets a summary rebuilt from
     its events, and says so.
  2. Every time is relative to the dump (``mono_ns`` in the header), in milliseconds, never negative
     for an event recorded before it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from kvown.runtime.flight import read_flight_file

USAGE = "usage: kvown inspect [--json] [--hops] FILE [FILE...]"


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The post-mortem of one dump as plain values (what ``--json`` prints)."""
    header = next((r for r in records if r.get("type") == "header"), None)
    if header is None:
        raise ValueError("no header line")
    events = sorted((r for r in records if r.get("type") == "event"), key=lambda e: e["t_ns"])
    last_by_rid: dict[Any, int] = {}
    for ev in events:
        if ev["request_id"] is not None:
            last_by_rid[ev["request_id"]] = ev["t_ns"]
    opened = [r for r in records if r.get("type") == "open_session"]
    source = "cores" if opened or any(r.get("type") == "open_session_error" for r in records) else "events"
    if source == "events":
        opened = _rebuilt_from_events(events)
    now = header["mono_ns"]
    sessions = []
    for s in opened:
        last = last_by_rid.get(s["request_id"])
        sessions.append({**s, "open_ms": _ago_ms(now, s.get("opened_ns")),
                         "draining_ms": _ago_ms(now, s.get("drain_started_ns")),
                         "last_event_ms": _ago_ms(now, last),
                         "deadline_in_ms": None if s.get("fatal_deadline_ns") is None
                         else round((s["fatal_deadline_ns"] - now) / 1e6, 3)})
    sessions.sort(key=lambda s: -(s["open_ms"] or 0))
    return {"rank": header["rank"], "pid": header["pid"], "reason": header["reason"],
            "request_id": header["request_id"], "detail": header["detail"], "wall_time_s": header["wall_time_s"],
            "events": len(events), "capacity": header["capacity"], "dropped": header["dropped"],
            "open_sessions_from": source, "open_sessions": sessions,
            "threads": sum(1 for r in records if r.get("type") == "stack")}


def _ago_ms(now_ns: int, t_ns: int | None) -> float | None:
    return None if t_ns is None else round(max(0, now_ns - t_ns) / 1e6, 3)


def _rebuilt_from_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rule 1's fallback: requests that opened in the ring and never retired there."""
    out: dict[Any, dict[str, Any]] = {}
    for ev in events:
        rid, kind = ev["request_id"], ev["kind"]
        if kind in ("open_receive", "open_send"):
            role = "receiver" if kind == "open_receive" else "sender"
            writers = ev["detail"].get("writers") or []
            out[rid] = {"role": role, "request_id": rid, "state": "open", "outcome": None, "opened_ns": ev["t_ns"],
                        "writers": [{"rank": w} for w in writers], "missing": ["unknown (rebuilt from events)"]}
        elif rid in out and kind == "conclude":
            out[rid]["outcome"] = ev["detail"].get("outcome")
        elif kind == "retire":
            out.pop(rid, None)
    return list(out.values())


def _writer_text(w: dict[str, Any]) -> str:
    flags = [name.replace("_", " ") for name in ("settled", "acked", "stream_ended", "cancel_sent") if w.get(name)]
    if w.get("in_doubt"):
        flags.append(f"in doubt {w['in_doubt']}")
    return f"rank {w['rank']}" + (f" ({', '.join(flags)})" if flags else "")


def _format(records: list[dict[str, Any]]) -> str:
    s = summarize(records)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["wall_time_s"]))
    out = [f"kvown flight recorder: rank {s['rank']} pid {s['pid']} at {when}",
           f"  reason: {s['reason']}  request: {s['request_id']}", f"  detail: {s['detail']}", ""]
    sessions = s["open_sessions"]
    note = "" if s["open_sessions_from"] == "cores" else " (rebuilt from the events: the dump has no core state)"
    out.append(f"open at the dump: {len(sessions)} session(s){note}")
    for x in sessions:
        out.append(f"  {x['role']:<8} req {x['request_id']}  state {x['state']}  outcome {x['outcome'] or '-'}"
                   + (f" ({x['reason']})" if x.get("reason") else ""))
        times = [f"open {x['open_ms']} ms" if x["open_ms"] is not None else "not exposed",
                 f"last event {x['last_event_ms']} ms ago" if x["last_event_ms"] is not None else "no event kept"]
        if x["draining_ms"] is not None:
            times.append(f"draining {x['draining_ms']} ms ({x.get('drain_reason', '')})")
        if x["deadline_in_ms"] is not None:
            times.append(f"fail-stop deadline {'in' if x['deadline_in_ms'] >= 0 else 'passed'} "
                         f"{abs(x['deadline_in_ms'])} ms")
        out.append("           " + ", ".join(times))
        out.append("           writers: " + ("; ".join(_writer_text(w) for w in x["writers"]) or "none yet"))
        out.append("           missing proof: " + (", ".join(x["missing"]) or "none"))
    out += ["", f"events: {s['events']} kept of capacity {s['capacity']} (dropped {s['dropped']}), oldest first; "
                "times before the dump"]
    out += _event_lines(records)
    stacks = [r for r in records if r.get("type") == "stack"]
    if stacks:
        out += ["", f"threads at the dump: {len(stacks)}"]
    for st in stacks:
        out.append(f"  thread {st['thread_name']} (id {st['thread_id']}, daemon={st['daemon']}):")
        out.extend(f"      {frame}" for frame in st["frames"])
    return "\n".join(out) + "\n"


def _event_lines(records: list[dict[str, Any]]) -> list[str]:
    header = next(r for r in records if r.get("type") == "header")
    lines = []
    for ev in sorted((r for r in records if r.get("type") == "event"), key=lambda e: e["t_ns"]):
        ago_ms = (header["mono_ns"] - ev["t_ns"]) / 1e6
        rid = "-" if ev["request_id"] is None else ev["request_id"]
        det = " ".join(f"{k}={v}" for k, v in ev["detail"].items())
        lines.append(f"  {-ago_ms:11.3f} ms  req {rid:<8} {ev['kind']:<20} {det}")
    return lines


def inspect_main(argv: list[str] | None = None) -> int:
    """``kvown inspect [--json] FILE...``: print flight recorder dumps as post-mortems; an exit code.

    Called: by the CLI, once per invocation, main thread. After error: prints the problem to stderr
    and returns 2 (missing file, not a flight recorder dump).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    as_json, hops = "--json" in args, "--hops" in args
    args = [a for a in args if a not in ("--json", "--hops")]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2
    if hops:
        return _hops_main(args, as_json)
    status, summaries = 0, []
    for path in args:
        try:
            records = read_flight_file(path)
            if as_json:
                summaries.append({"file": path, **summarize(records)})
            else:
                sys.stdout.write(_format(records))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"kvown inspect: {path}: not a readable flight recorder dump: {exc}", file=sys.stderr)
            status = 2
    if as_json:
        print(json.dumps(summaries, indent=2, default=repr))
    return status


def _hops_main(paths: list[str], as_json: bool) -> int:
    """``--hops``: one table over every dump; 2 if any file is not a readable dump (nothing printed)."""
    from kvown.apps.hops import format_hops, hop_report, load

    dumps = []
    for path in paths:
        try:
            dumps.append(load(read_flight_file(path)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"kvown inspect: {path}: not a readable flight recorder dump: {exc}", file=sys.stderr)
            return 2
    try:
        report = hop_report(dumps)
    except ValueError as exc:
        print(f"kvown inspect --hops: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(report, indent=2) + "\n" if as_json else format_hops(report))
    return 0
