"""``kvown inspect --hops FILE...``: where sessions' time went, read from the flight dumps of a world's ranks.

Owns: the hop table. Every figure is the time between two recorded events where the first happens
before the second, so on one clock none can be negative:
  - frame: the sender's ``send`` (noted before the frame goes out) -> the receiver's ``recv`` of that
    frame, matched by (src, dst, seq); one figure per message the frame carries;
  - carried: the writer's ``post`` of a WRITE that carries its report (noted before the post) -> the
    receiver's ``recv_carried`` of it, matched by (request id, writer rank);
  - stage: two consecutive events of one session on one rank.

Rules:
  1. Cross-rank figures only between dumps whose headers name the same clock (``clock``:
     ``kvown.runtime.flight.clock_identity``); other rank pairs are listed as not comparable, never
     guessed from wall time.
  2. A cross-rank pair that comes out negative proves the two clocks differ after all: every figure of
     that rank pair is dropped and the pair is reported as inconsistent.
  3. An event that fell out of its ring matches nothing and is not counted.
  4. Several dumps of one rank process (a bench writes one per new slow session) are one ring read at
     different times: their events are merged, each counted once. Two processes for one rank are two
     worlds: refused (``ValueError``), as is an event line without its fields.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from kvown.apps.benchmarks.common import pct

Pair = tuple[int, int]  # (from rank, to rank)


@dataclass(frozen=True)
class Dump:
    """One rank's dump: its rank, process, event clock's identity and events, oldest first."""

    rank: int
    pid: int
    clock: str | None
    events: list[dict[str, Any]]


def load(records: list[dict[str, Any]]) -> Dump:
    """A ``Dump`` of ``read_flight_file``'s records. After error: ``ValueError`` naming what is missing."""
    header = next((r for r in records if r.get("type") == "header"), None)
    if header is None:
        raise ValueError("no header line")
    events = [r for r in records if r.get("type") == "event"]
    for ev in events:
        if not (type(ev.get("t_ns")) is int and isinstance(ev.get("kind"), str)
                and isinstance(ev.get("detail"), dict) and "request_id" in ev):
            raise ValueError(f"an event line without t_ns, kind, request_id or detail: {ev}")
    events.sort(key=lambda e: e["t_ns"])
    return Dump(int(header["rank"]), int(header["pid"]), header.get("clock"), events)


def merge(dumps: list[Dump]) -> list[Dump]:
    """Rule 4: one ``Dump`` per rank, in rank order. After error: ``ValueError`` (two processes, one rank)."""
    by_rank: dict[int, list[Dump]] = collections.defaultdict(list)
    for d in dumps:
        by_rank[d.rank].append(d)
    out = []
    for rank, same in sorted(by_rank.items()):
        if len({(d.pid, d.clock) for d in same}) > 1:
            raise ValueError(f"rank {rank} comes from more than one process: "
                             "read one world's dumps at a time")
        seen = {(e["t_ns"], e["kind"], e["request_id"]): e for d in same for e in d.events}
        out.append(Dump(rank, same[0].pid, same[0].clock, sorted(seen.values(), key=lambda e: e["t_ns"])))
    return out


def comparable(a: Dump, b: Dump) -> bool:
    """Rule 1: one clock, named by both headers."""
    return a.clock is not None and a.clock == b.clock


def _label(ev: dict[str, Any]) -> str:
    msg = ev["detail"].get("msg") if ev["kind"] in ("recv", "recv_carried") else None
    return f"{ev['kind']} {msg}" if msg else ev["kind"]


def stage_hops(dumps: list[Dump]) -> dict[str, list[int]]:
    """Consecutive events of one session on one rank: ``"r{rank} {from} -> {to}"`` -> durations (ns)."""
    out: dict[str, list[int]] = collections.defaultdict(list)
    for d in dumps:
        last: dict[int, dict[str, Any]] = {}
        for ev in d.events:
            rid = ev["request_id"]
            if rid is None:
                continue
            prev = last.get(rid)
            if prev is not None:
                out[f"r{d.rank} {_label(prev)} -> {_label(ev)}"].append(ev["t_ns"] - prev["t_ns"])
            last[rid] = ev
    return dict(out)


def _frame_key(src: int, dst: int, seq: int) -> tuple[int, int, int]:
    return (src, dst, seq)


def cross_hops(dumps: list[Dump]) -> dict[Pair, dict[str, list[int]]]:
    """Frame and carried figures per (from rank, to rank), before rule 2; only comparable pairs."""
    by_rank = {d.rank: d for d in dumps}
    sent: dict[tuple[int, int, int], int] = {}
    posted: dict[tuple[int, int], int] = {}
    for d in dumps:
        for ev in d.events:
            det = ev["detail"]
            if ev["kind"] == "send" and "dst" in det and "seq" in det:
                key = _frame_key(d.rank, det["dst"], det["seq"])
                sent.setdefault(key, ev["t_ns"])  # a resent frame keeps its first send
            elif ev["kind"] == "post" and det.get("carried") and ev["request_id"] is not None:
                posted.setdefault((ev["request_id"], d.rank), ev["t_ns"])
    out: dict[Pair, dict[str, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for d in dumps:
        for ev in d.events:
            det = ev["detail"]
            src = det.get("src")
            if src not in by_rank or not comparable(by_rank[src], d):
                continue
            t0 = sent.get(_frame_key(src, d.rank, det.get("seq"))) if ev["kind"] == "recv" else None
            if t0 is not None:
                out[(src, d.rank)][f"frame {det['msg']} r{src} -> r{d.rank}"].append(ev["t_ns"] - t0)
            elif ev["kind"] == "recv_carried" and (ev["request_id"], src) in posted:
                t0 = posted[(ev["request_id"], src)]
                out[(src, d.rank)][f"carried {det['msg']} r{src} -> r{d.rank} (post -> received)"].append(
                    ev["t_ns"] - t0)
    return {pair: dict(hops) for pair, hops in out.items()}


def _consistent(hops: dict[str, list[int]]) -> bool:
    """Rule 2: no figure of one rank pair is negative."""
    return all(v >= 0 for values in hops.values() for v in values)


def hop_report(dumps: list[Dump]) -> dict[str, Any]:
    """The whole table as plain values (what ``--json`` prints): rows sorted by total time.
    After error: ``ValueError`` from ``merge``."""
    dumps = merge(dumps)
    rows = stage_hops(dumps)
    inconsistent = []
    for pair, hops in sorted(cross_hops(dumps).items()):
        if not _consistent(hops):
            inconsistent.append(list(pair))
            continue
        rows.update(hops)
    ranks = [d.rank for d in dumps]
    by_rank = {d.rank: d for d in dumps}
    apart = [[a, b] for i, a in enumerate(ranks) for b in ranks[i + 1:]
             if not comparable(by_rank[a], by_rank[b])]
    table = [{"hop": name, **pct(values), "min_us": round(min(values) / 1e3, 1),
              "total_ms": round(sum(values) / 1e6, 3)} for name, values in rows.items() if values]
    table.sort(key=lambda r: -r["total_ms"])
    return {"ranks": ranks, "clocks": {str(d.rank): d.clock for d in dumps}, "not_comparable": apart,
            "inconsistent": inconsistent, "hops": table}


def format_hops(report: dict[str, Any], limit: int = 25) -> str:
    """The table for people: the ``limit`` hops with the most time in them, then what was left out."""
    out = [f"kvown hops: ranks {', '.join(map(str, report['ranks']))}; figures in us, most total time first"]
    for a, b in report["not_comparable"]:
        out.append(f"  ranks {a} and {b}: not one clock (different hosts, boots or an old dump): no figure "
                   "between them")
    for a, b in report["inconsistent"]:
        out.append(f"  ranks {a} -> {b}: a negative figure, so not one clock after all: "
                   "those figures dropped")
    out.append(f"  {'hop':<62} {'n':>6} {'p50':>9} {'p90':>9} {'max':>9} {'total ms':>9}")
    for r in report["hops"][:limit]:
        figures = " ".join(f"{r[k]:>9.1f}" for k in ("p50_us", "p90_us", "max_us", "total_ms"))
        out.append(f"  {r['hop']:<62} {r['n']:>6} {figures}")
    if len(report["hops"]) > limit:
        out.append(f"  ... {len(report['hops']) - limit} more in --json")
    return "\n".join(out) + "\n"
