"""Engine cost per session, scale, and fences: the protocol's own CPU bill, measured in one process.

Owns: a two-rank pair (a sender driver and a receiver driver, each over its own real NIXL agent - or
the fake library with ``--fake``) stepped by ONE thread, so every microsecond of engine work is
counted once and nothing else runs in between. The drivers, cores, codec, transport, pool and API
facades are the production ones; only the engine thread's loop is replaced by ``_step`` below.

Parts (``--parts``; what each measures in full: docs/design.md section 16):
  engine    CPU time inside ``Driver.step`` per session and side, W1 lifecycle (levers ``--no-carry``,
            ``--no-batch``); steps, frames and messages per session.
  scale     per-session cost at (100 live, 100 fences) vs (10,000 live, 1,000,000 fences):
            ``scale_cost_ratio`` (target <= 1.5).
  fence     bytes per fenced id at 1,000,000 ids and lookup time, vs a ``dict[int, bool]``.
  w4        descriptor sweep, 16..256 tokens per block, contiguous vs scattered, kvown vs B0.

Rules:
  1. Fixed seeds; a fresh pair per measurement; warm-up sessions are not counted.
  2. No real clock in the cores' decisions beyond the engine's own (``time.monotonic_ns``), and every
     wait is a bounded number of steps.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import random
import sys
import time
import tracemalloc
from dataclasses import dataclass, replace
from typing import Any, Callable

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from kvown.apps.benchmarks.common import KIB, count, count0, emit, environment, progress  # noqa: E402

MAX_ROUNDS = 2_000_000  # bound on step rounds of one measurement
PARTS = ("engine", "scale", "fence", "w4", "levers")  # --parts


@dataclass(frozen=True)
class PairSpec:
    block_nbytes: int = 64 * KIB
    num_blocks: int = 256
    carry: bool = True
    batch: bool = True
    coalesce: bool = True
    fake: bool = False
    timeout_s: float = 60.0


class Pair:
    """A sender rank (0) and a receiver rank (1): production drivers stepped by the calling thread."""

    def __init__(self, spec: PairSpec, wrap_agent: Callable[[int, Any], Any] | None = None) -> None:
        """``wrap_agent(rank, agent)``: what each rank's endpoint drives instead of its real NIXL agent
        (a call timer); not with ``spec.fake``."""
        from kvown.adapters.nixl import NixlEndpoint, make_agent
        from kvown.cache.layout import KVLayout
        from kvown.runtime.config import TransferConfig
        from kvown.testing.fake_nixl import FakeFabric, FakeNixlEndpoint
        from kvown.testing.pair import DriverPair

        heads, dim, layers = 2, 128, 4
        tokens = spec.block_nbytes // (layers * 2 * heads * dim * 2)
        layout = KVLayout.standard(num_layers=layers, num_blocks=spec.num_blocks, tokens_per_block=tokens,
                                   num_kv_heads=heads, head_dim=dim, dtype="bfloat16")
        assert layout.block_nbytes == spec.block_nbytes, layout.block_nbytes
        fields = TransferConfig.__dataclass_fields__
        levers = {k: v for k, v in (("carry_results", spec.carry), ("coalesce_writes", spec.coalesce)) if k in fields}
        config = TransferConfig(transfer_timeout_s=spec.timeout_s, metrics_port=0, **levers)
        # no oracle reads the fake's record of posted WRITEs here: keeping it would grow the heap the
        # collector walks, and that would be counted as kvown's cost
        fabric = FakeFabric(default_delay_polls=0, record_posted=False) if spec.fake else None
        self.fabric = fabric
        tag = f"cost{os.getpid()}-{id(self) & 0xFFFF:x}"

        def endpoint(rank: int) -> Any:
            name = f"{tag}-r{rank}"
            if fabric is not None:
                return FakeNixlEndpoint(name, fabric=fabric)
            return NixlEndpoint(name, agent=None if wrap_agent is None else wrap_agent(rank, make_agent(name)))

        pair = DriverPair(config, layout=layout, key=b"cost-bench-key-0123456789", clock=time.monotonic_ns,
                          recorder_clock=time.monotonic_ns, endpoint=endpoint,
                          on_fail_stop=lambda rank, action: self._fatal(action), engine_fail_stop=self._fatal)
        self.layout = layout
        self.drivers: dict[int, Any] = pair.drivers
        if not spec.batch:
            for driver in self.drivers.values():
                driver.batch_frames = False
        self.tx, self.rx = pair.tx, pair.rx
        self.transports = pair.transports
        self.cpu_ns = [0, 0]
        self.steps = [0, 0]
        self._overhead_ns = _clock_overhead_ns()

    @staticmethod
    def _fatal(action: Any) -> None:
        raise RuntimeError(f"the benchmark pair fail-stopped: {action}")

    def step(self, rank: int) -> bool:
        t0 = time.thread_time_ns()
        moved = self.drivers[rank].step(time.monotonic_ns())
        self.cpu_ns[rank] += time.thread_time_ns() - t0 - self._overhead_ns
        self.steps[rank] += 1
        return moved

    def reset(self) -> None:
        self.cpu_ns, self.steps = [0, 0], [0, 0]
        for d in self.drivers.values():
            d.stats.clear()

    def run(self, rids: list[int], nb: int, window: int, bar: Any = None) -> None:
        """The W1 lifecycle for every id, ``window`` sessions in flight (bounded)."""
        live: collections.deque = collections.deque()
        todo = collections.deque(rids)
        done = 0
        for _ in range(MAX_ROUNDS):
            while todo and len(live) < window:
                rid = todo.popleft()
                slot = len(rids) - len(todo) - 1
                first = (slot % window) * nb
                ticket = self.rx.submit_receive(rid, nb, (0,))
                self.step(1)
                live.append(ticket.future.result(0))
                self.tx.send(rid, range(first, first + nb))
            self.step(0)
            self.step(1)
            for h in live:
                if h.landed.is_set() and not h.closing:
                    self.rx.release(h.request_id)
            while live and live[0].retired.is_set():
                live.popleft()
                done += 1
                if bar is not None:
                    bar.update(1)
            if done == len(rids):
                break
        else:
            raise RuntimeError("sessions did not finish within the step bound")
        for _ in range(64):  # let the sender see its last DONEs and release its sources
            if not (self.step(0) | self.step(1)):
                break

    def close(self) -> None:
        self.settle_frames()
        for t in self.transports.values():
            try:
                t.close()
            except Exception:  # noqa: BLE001 - teardown of a benchmark
                pass

    def settle_frames(self, quiet_rounds: int = 32, max_rounds: int = 20_000) -> int:
        """Progress both agents in turn until ``quiet_rounds`` rounds in a row bring no frame (at most
        ``max_rounds``), dropping what arrives: a frame one side sent and the other never stepped for
        (``_burst``) sits in the sender's UCX, and closing its peer first would cancel each one (NIXL logs
        "UCX AM send failed with status -16" per frame). Each endpoint's own close flush cannot do this:
        it progresses one agent while the other is not. Returns the frames dropped."""
        endpoints = [t.endpoint for t in self.transports.values()]
        dropped = quiet = 0
        for _ in range(max_rounds):
            got = sum(len(ep.drain_notifs()) for ep in endpoints)
            dropped += got
            quiet = 0 if got else quiet + 1
            if quiet >= quiet_rounds:
                break
        return dropped


class _Timed:
    """Wraps a NIXL agent: counts and times every library call (CPU time), for the cost breakdown."""

    def __init__(self, agent: Any, sink: collections.Counter, counts: collections.Counter) -> None:
        self._agent, self._sink, self._counts = agent, sink, counts

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._agent, name)
        if not callable(fn):
            return fn
        sink, counts = self._sink, self._counts

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return fn(*a, **k)
            finally:
                sink[name] += time.thread_time_ns() - t0
                counts[name] += 1

        self.__dict__[name] = timed  # made once per name: later calls skip __getattr__
        return timed


def _timed_overhead_ns(n: int = 20_000) -> tuple[float, float]:
    """What ``_Timed`` adds to one call, measured on a no-op: (inside its sink: the clock pair, which
    the breakdown would bill to NIXL; in all: that plus the wrapper, billed to the engine's step)."""

    class Noop:
        def call(self) -> None:
            return None

    sink: collections.Counter = collections.Counter()
    direct, timed = Noop(), _Timed(Noop(), sink, collections.Counter())
    timed.call()
    sink.clear()
    t0 = time.thread_time_ns()
    for _ in range(n):
        direct.call()
    t1 = time.thread_time_ns()
    for _ in range(n):
        timed.call()
    t2 = time.thread_time_ns()
    return sink["call"] / n, max(0.0, ((t2 - t1) - (t1 - t0)) / n)


def _clock_overhead_ns() -> int:
    """The cost of one ``thread_time_ns`` pair (subtracted from every step; ~1.4 us on a slow VM)."""
    n = 2000
    t0 = time.perf_counter_ns()
    for _ in range(n):
        time.thread_time_ns()
    return int((time.perf_counter_ns() - t0) / n)


class Rids:
    def __init__(self, epoch: int = 1) -> None:
        self.epoch, self.seq = epoch, 0

    def take(self, n: int) -> list[int]:
        from kvown.core.ids import make_request_id

        out = [make_request_id(self.epoch, self.seq + i) for i in range(n)]
        self.seq += n
        return out


# ---------------------------------------------------------------------------------------------- engine


def nixl_breakdown(sessions: int, window: int, spec: PairSpec, nb: int = 1) -> dict[str, Any]:
    """Per session of ``nb`` blocks and side: the CPU spent inside NIXL library calls, and the number of
    calls, so the engine's own Python share is the engine figure minus this."""
    sinks: list[collections.Counter[str]] = [collections.Counter(), collections.Counter()]
    counts: list[collections.Counter[str]] = [collections.Counter(), collections.Counter()]
    pair = Pair(replace(spec, num_blocks=max(spec.num_blocks, window * nb)),
                wrap_agent=lambda rank, agent: _Timed(agent, sinks[rank], counts[rank]))
    try:
        rids = Rids()
        pair.run(rids.take(100), nb, window)
        for counter in (*sinks, *counts):  # the warm-up's calls are nobody's figure
            counter.clear()
        pair.reset()
        pair.run(rids.take(sessions), nb, window)
        in_sink_ns, in_all_ns = _timed_overhead_ns()
        out = {}
        for rank, side in ((0, "sender"), (1, "receiver")):
            calls = sum(counts[rank].values())
            # the instrument's own cost, measured on a no-op beside the run, is nobody's: taken out of
            # both figures (before, the wrapper's Python was billed to kvown's own CPU)
            nixl_ns = sum(sinks[rank].values()) - calls * in_sink_ns
            engine_ns = pair.cpu_ns[rank] - calls * in_all_ns
            out[side] = {"engine_cpu_us": round(engine_ns / sessions / 1e3, 1),
                         "engine_cpu_us_instrumented": round(pair.cpu_ns[rank] / sessions / 1e3, 1),
                         "instrument_us": round(calls * in_all_ns / sessions / 1e3, 1),
                         "nixl_cpu_us": round(nixl_ns / sessions / 1e3, 1),
                         "nixl_calls": {k: round(v / sessions, 2) for k, v in counts[rank].items()},
                         "nixl_us_by_call": {k: round((v - counts[rank][k] * in_sink_ns) / sessions / 1e3, 1)
                                             for k, v in sinks[rank].items()}}
            out[side]["python_cpu_us"] = round((engine_ns - nixl_ns) / sessions / 1e3, 1)
        return out
    finally:
        pair.close()


class GcTime:
    """CPU time spent in the garbage collector's passes while entered (``gc.callbacks``), and how many
    were full (generation 2) collections: they land on whichever side allocated last, so the engine
    figures include them and this says how much of them it was."""

    def __init__(self) -> None:
        self.ns, self.full, self._t0 = 0, 0, 0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.thread_time_ns()
            return
        self.ns += time.thread_time_ns() - self._t0
        self.full += info["generation"] == 2

    def __enter__(self) -> "GcTime":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)


def engine_cost(sessions: int, window: int, nb: int, spec: PairSpec, reps: int = 3, warmup: int = 200,
                bar: bool = False) -> dict[str, Any]:
    """CPU per session per side (median of ``reps`` runs on fresh pairs), and what the steps did."""
    runs = []
    with progress(reps * sessions, f"engine cost ({nb} x {spec.block_nbytes // KIB} KiB)", bar) as pbar:
        for _ in range(reps):
            pair = Pair(replace(spec, num_blocks=max(spec.num_blocks, window * nb)))
            rids = Rids()
            try:
                pair.run(rids.take(warmup), nb, window)
                gc.collect()
                pair.reset()
                t0 = time.perf_counter_ns()
                with GcTime() as gc_time:
                    pair.run(rids.take(sessions), nb, window, pbar)
                wall = time.perf_counter_ns() - t0
                tx, rx = pair.drivers[0].stats, pair.drivers[1].stats
                runs.append({
                    "sender_cpu_us": pair.cpu_ns[0] / sessions / 1e3,
                    "receiver_cpu_us": pair.cpu_ns[1] / sessions / 1e3,
                    "wall_us": wall / sessions / 1e3,
                    "sender_steps": pair.steps[0] / sessions, "receiver_steps": pair.steps[1] / sessions,
                    "control_frames": (tx["control_sent"] + rx["control_sent"]) / sessions,
                    "control_messages": (tx["control_messages"] + rx["control_messages"]) / sessions,
                    "gc_us": gc_time.ns / sessions / 1e3, "gc_full_collections": gc_time.full,
                })
            finally:
                pair.close()
    med = {k: round(sorted(r[k] for r in runs)[len(runs) // 2], 2) for k in runs[0]}
    med.update(sessions=sessions, window=window, blocks=nb, block_nbytes=spec.block_nbytes, reps=reps,
               carry=spec.carry, batch=spec.batch, coalesce=spec.coalesce, fake=spec.fake,
               clock_overhead_ns=_clock_overhead_ns(), runs=runs)
    med["max_side_cpu_us"] = max(med["sender_cpu_us"], med["receiver_cpu_us"])
    return med


# ---------------------------------------------------------------------------------------------- scale


def scale_point(live: int, fences: int, probe: int, spec: PairSpec, seed: int) -> dict[str, Any]:
    """Per-session CPU of ``probe`` sessions while ``live`` sessions are open and ``fences`` ids fenced."""
    from kvown.core.fence import CancelOrigin
    from kvown.core.ids import MAX_SEQ, make_request_id

    pair = Pair(replace(spec, num_blocks=live + 16))
    try:
        rng = random.Random(seed)
        for rid in (make_request_id(3 + (i % 4), s) for i, s in enumerate(rng.sample(range(MAX_SEQ), fences))):
            pair.drivers[0].sender.fence.install(rid, CancelOrigin.CLIENT)
            pair.drivers[1].receiver.fence.install(rid, CancelOrigin.CLIENT)
        background = Rids(epoch=2).take(live)
        tickets = [pair.rx.submit_receive(rid, 1, (0,)) for rid in background]  # published, never sent
        saved = pair.drivers[0].sender._saved
        for _ in range(MAX_ROUNDS):  # published on the receiver, saved on the sender (bounded)
            pair.step(1)
            pair.step(0)
            if all(t.future.done() for t in tickets) and sum(map(len, saved.values())) == live:
                break
        else:
            raise RuntimeError("the background publications did not arrive")
        assert len(pair.drivers[1].receiver.sessions) == live
        rids = Rids(epoch=1)
        pair.run(rids.take(100), 1, 4)  # warm-up
        gc.collect()
        pair.reset()
        pair.run(rids.take(probe), 1, 4)
        return {"live": live, "fences": fences, "probe": probe,
                "cost_us": round((pair.cpu_ns[0] + pair.cpu_ns[1]) / probe / 1e3, 2),
                "sender_cpu_us": round(pair.cpu_ns[0] / probe / 1e3, 2),
                "receiver_cpu_us": round(pair.cpu_ns[1] / probe / 1e3, 2)}
    finally:
        pair.close()


def scale(levels: list[tuple[int, int]], probe: int, reps: int, spec: PairSpec, bar: bool) -> dict[str, Any]:
    points = []
    with progress(len(levels) * reps, "scale", bar) as pbar:
        for live, fences in levels:
            samples = []
            for r in range(reps):
                samples.append(scale_point(live, fences, probe, spec, seed=1000 + r))
                pbar.update(1)
            best = min(samples, key=lambda p: p["cost_us"])  # least disturbed run (a shared machine)
            best["cost_us_runs"] = [p["cost_us"] for p in samples]
            points.append(best)
    ratio = points[-1]["cost_us"] / points[0]["cost_us"]
    return {"points": points, "scale_cost_ratio": round(ratio, 3), "target": 1.5, "met": ratio <= 1.5}


# ---------------------------------------------------------------------------------------------- fence


def fence(n: int, seed: int) -> dict[str, Any]:
    """Bytes per fenced id and lookup cost at ``n`` ids, against a ``dict[int, bool]``."""
    from kvown.core.fence import CancellationFence, CancelOrigin
    from kvown.core.ids import MAX_SEQ, make_request_id

    rng = random.Random(seed)
    seqs = rng.sample(range(MAX_SEQ + 1), 2 * n)
    ids = [make_request_id(i % 4, s) for i, s in enumerate(seqs[:n])]
    misses = [make_request_id(i % 4, s) for i, s in enumerate(seqs[n:])]
    probe_hits, probe_misses = ids[: min(n, 200_000)], misses[: min(n, 200_000)]

    def lookup_ns(contains: Any, keys: list[int]) -> float:
        t0 = time.perf_counter_ns()
        for k in keys:
            contains(k)
        return round((time.perf_counter_ns() - t0) / len(keys), 1)

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    f = CancellationFence()
    t0 = time.perf_counter_ns()
    for rid in ids:
        f.install(rid, CancelOrigin.CLIENT)
    install_ns = (time.perf_counter_ns() - t0) / n
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    table = {rid: False for rid in ids}
    dict_traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(f) == n
    return {"ids": n, "seed": seed, "fence_bytes_per_id": round(f.nbytes() / n, 2),
            "fence_tracemalloc_bytes_per_id": round(traced / n, 2),
            "dict_tracemalloc_bytes_per_id": round(dict_traced / n, 2),
            "fence_install_ns": round(install_ns, 1),
            "fence_hit_ns": lookup_ns(f.is_fenced, probe_hits), "fence_miss_ns": lookup_ns(f.is_fenced, probe_misses),
            "dict_hit_ns": lookup_ns(table.__contains__, probe_hits),
            "dict_miss_ns": lookup_ns(table.__contains__, probe_misses),
            "target_bytes_per_id": 16, "met": f.nbytes() / n <= 16}


# ---------------------------------------------------------------------------------------------- W4


def descriptor_point(tokens: int, session_nbytes: int, scattered: bool, sessions: int, spec: PairSpec
                     ) -> dict[str, Any]:
    from kvown.adapters.nixl import XferStatus

    block = tokens * 4 * KIB
    nb = session_nbytes // block
    pair = Pair(replace(spec, block_nbytes=block, num_blocks=4 * nb + 8))
    try:
        if scattered:  # hold every other block on both sides: each session's blocks are nb runs
            for rank in (0, 1):
                pool = pair.drivers[rank].pool
                held = pool.allocate(pool.layout.num_blocks, owner="w4-all")
                pool.retire([b for b in held if b % 2 == 0], owner="w4-all")
        rids = Rids()
        t_runs = []
        for label, n in (("warm", 8), ("measured", sessions)):
            ids = rids.take(n)
            if label == "measured":
                gc.collect()
                pair.reset()
            t0 = time.perf_counter_ns()
            _run_sessions(pair, ids, nb)
            t_runs.append(time.perf_counter_ns() - t0)
        kv_cpu = (pair.cpu_ns[0] + pair.cpu_ns[1]) / sessions
        kv_wall = t_runs[-1] / sessions
        # B0: the same descriptors, posted raw between the same two agents (prepped lists, same indices)
        tx = pair.drivers[0].transport
        rx_name = pair.transports[1].info.agent_name
        idx = list(range(0, 2 * nb, 2)) if scattered else list(range(nb))
        ep = tx.endpoint
        lp, rp = tx._local_prep, tx._remote_prep[1]
        raw = []
        for i in range(sessions + 8):
            t0 = time.perf_counter_ns()
            h = ep.post_write_blocks(rx_name, lp, idx, rp, idx)
            for _ in range(1_000_000):
                if ep.poll(h) is not XferStatus.IN_PROGRESS:
                    break
                pair.transports[1].endpoint.drain_notifs()
            ep.release(h)
            if i >= 8:
                raw.append(time.perf_counter_ns() - t0)
        raw_us = sorted(raw)[len(raw) // 2] / 1e3
        return {"tokens_per_block": tokens, "block_nbytes": block, "blocks": nb, "scattered": scattered,
                "descriptors": nb if scattered else 1, "session_nbytes": session_nbytes,
                "kvown_cpu_us": round(kv_cpu / 1e3, 1), "kvown_cpu_us_per_block": round(kv_cpu / 1e3 / nb, 2),
                "kvown_wall_us": round(kv_wall / 1e3, 1), "kvown_gbps": round(session_nbytes / kv_wall, 3),
                "raw_post_to_done_us": round(raw_us, 1), "raw_gbps": round(session_nbytes / (raw_us * 1e3), 3),
                "kvown_overhead_us": round(kv_cpu / 1e3 - raw_us, 1),
                "ratio": round((session_nbytes / kv_wall) / (session_nbytes / (raw_us * 1e3)), 3)}
    finally:
        pair.close()


def _run_sessions(pair: Pair, rids: list[int], nb: int) -> None:
    """One session at a time (the descriptor cost, not the overlap, is the question)."""
    for rid in rids:
        ticket = pair.rx.submit_receive(rid, nb, (0,))
        pair.step(1)
        h = ticket.future.result(0)
        pair.tx.send(rid, h.blocks if False else tuple(_source_blocks(pair, nb)))
        for _ in range(MAX_ROUNDS):
            pair.step(0)
            pair.step(1)
            if h.landed.is_set():
                break
        pair.rx.release(rid)
        for _ in range(MAX_ROUNDS):
            pair.step(1)
            pair.step(0)
            if h.retired.is_set() and not pair.drivers[0]._sends:
                break


def _source_blocks(pair: Pair, nb: int) -> list[int]:
    """The sender's source blocks: its free blocks, as laid out (contiguous or every other one)."""
    pool = pair.drivers[0].pool
    free = pool.free_blocks()
    return list(free[:nb])


def w4(tokens_list: list[int], session_nbytes: int, sessions: int, spec: PairSpec, bar: bool) -> dict[str, Any]:
    points = []
    with progress(2 * len(tokens_list), "W4 descriptor sweep", bar) as pbar:
        for scattered in (False, True):
            for tokens in tokens_list:
                points.append(descriptor_point(tokens, session_nbytes, scattered, sessions, spec))
                pbar.update(1)
    return {"points": points}


# ---------------------------------------------------------------------------------------------- levers


def _ns_per_call(fn: Any, n: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return round(best, 1)


def levers(n: int, spec: PairSpec) -> dict[str, Any]:
    """Micro-measurements of the per-frame and per-event levers, each against the way it was done before
    (reproduced inline here), and the batching lever on a burst of publications."""
    import hashlib
    import hmac as hmac_mod

    import msgpack

    from kvown.adapters.codec import FrameCodec
    from kvown.core.messages import Envelope, KvResult, Mac, RequestData, ResultStatus, to_wire
    from kvown.runtime.flight import FlightRecorder, event_code

    key = b"levers-key-0123456789abcdef!!!!!"
    body = msgpack.packb([1, 3, 0, 1, 5, 0, 123456789, 0, True, 0, 0])
    mac = Mac(key)
    out: dict[str, Any] = {
        "hmac_new_ns": _ns_per_call(lambda: hmac_mod.new(key, body, hashlib.sha256).digest(), n),
        "hmac_precomputed_ns": _ns_per_call(lambda: mac.tag(body), n),
    }
    ring: collections.deque = collections.deque(maxlen=4096)

    def old_record() -> None:  # the recorder before: a clock read, a kwargs dict, an enum name, a deque append
        ring.append((time.monotonic_ns(), "send", 7, {"msg": ResultStatus.SUCCESS.name, "dst": 1, "seq": 5}))

    rec = FlightRecorder(0)
    code = event_code("lever_send", "msg", "dst", "seq")
    out["recorder_old_ns"] = _ns_per_call(old_record, n)
    out["recorder_note_ns"] = _ns_per_call(lambda: rec.note(code, 7, 3, 1, 5), n)
    m = KvResult(0, 123456789, 0, True, ResultStatus.SUCCESS, 0)
    env = Envelope(0, 1, 5, m)
    codec = FrameCodec(key)

    def old_encode() -> bytes:
        b = msgpack.packb(to_wire(env), use_bin_type=True)
        return b + hmac_mod.new(key, b, hashlib.sha256).digest()

    frame = codec.encode(0, 1, 5, [m])
    out["encode_old_ns"] = _ns_per_call(old_encode, n)
    out["encode_ns"] = _ns_per_call(lambda: codec.encode(0, 1, 5, [m]), n)
    out["decode_ns"] = _ns_per_call(lambda: codec.decode(frame), n)
    many = [RequestData(123456789 + i, 1, (i,), 0, 1, -1) for i in range(64)]
    out["encode_64_messages_one_frame_ns"] = _ns_per_call(lambda: codec.encode(0, 1, 5, many), max(1, n // 64))
    out["encode_64_frames_ns"] = _ns_per_call(lambda: [codec.encode(0, 1, 5, [x]) for x in many], max(1, n // 64))
    from concurrent.futures import Future
    import threading

    from kvown.runtime.commands import ReceiveHandle

    def old_handle() -> tuple:  # a receive handle before: a Future and three threading.Events
        return (Future(), threading.Event(), threading.Event(), threading.Event())

    out["handle_old_ns"] = _ns_per_call(old_handle, max(1, n // 4))
    out["handle_ns"] = _ns_per_call(lambda: ReceiveHandle(1, (1,), -1), max(1, n // 4))
    out["python_calls_per_session"] = python_calls(500, spec)
    out["burst"] = {}
    for mode in ("batch", "one_frame_per_message"):  # the least disturbed of 5 (a shared machine)
        runs = [_burst(256, spec, mode == "batch") for _ in range(5)]
        best = min(runs, key=lambda r: r["receiver_cpu_us"])
        best["cpu_us_per_publication_runs"] = [r["cpu_us_per_publication"] for r in runs]
        out["burst"][mode] = best
    return out


def python_calls(sessions: int, spec: PairSpec) -> dict[str, float]:
    """Python-visible function calls per session and side inside ``Driver.step`` (cProfile counts): a
    load-independent measure of the engine's work, for comparisons across runs and machines."""
    import cProfile
    import pstats

    pair = Pair(replace(spec, num_blocks=max(spec.num_blocks, 8)))
    profs = [cProfile.Profile(), cProfile.Profile()]
    on = [False]
    plain = pair.step

    def step(rank: int) -> bool:
        if not on[0]:
            return plain(rank)
        profs[rank].enable()
        try:
            return pair.drivers[rank].step(time.monotonic_ns())
        finally:
            profs[rank].disable()

    pair.step = step  # type: ignore[method-assign]
    try:
        rids = Rids()
        pair.run(rids.take(100), 1, 4)
        on[0] = True
        pair.run(rids.take(sessions), 1, 4)
        return {side: round(sum(v[1] for v in pstats.Stats(profs[rank]).stats.values()) / sessions, 1)
                for rank, side in ((0, "sender"), (1, "receiver"))}
    finally:
        pair.close()


def _burst(n: int, spec: PairSpec, batch: bool) -> dict[str, Any]:
    """``n`` publications queued at once: the receiver's CPU and frames for that one step."""
    pair = Pair(replace(spec, block_nbytes=4 * KIB, num_blocks=n + 8, batch=batch))
    try:
        rids = Rids(epoch=2).take(n)
        tickets = [pair.rx.submit_receive(rid, 1, (0,)) for rid in rids]
        pair.reset()
        pair.step(1)
        assert all(t.future.done() for t in tickets)
        return {"publications": n, "receiver_cpu_us": round(pair.cpu_ns[1] / 1e3, 1),
                "cpu_us_per_publication": round(pair.cpu_ns[1] / n / 1e3, 2),
                "frames": pair.drivers[1].stats["control_sent"]}
    finally:
        pair.close()


# ---------------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = PairSpec(fake=args.fake)
    out: dict[str, Any] = {"benchmark": "cost", "environment": environment(args.seed)}
    parts = args.parts.split(",")
    if "engine" in parts:
        out["engine"] = engine_cost(args.sessions, args.window, 1, spec, args.reps, bar=args.progress)
        out["engine_breakdown"] = nixl_breakdown(args.sessions, args.window, spec)
        out["engine_4mib"] = engine_cost(max(50, args.sessions // 8), args.window, 64, spec, args.reps,
                                         bar=args.progress)
        # the same split for 4 MiB sessions: kvown's own CPU grows with the bytes the engine's core copies
        # (UCX cma), not with the blocks (docs/benchmarks.md, issue 19 sixteenth pass)
        out["engine_breakdown_4mib"] = nixl_breakdown(max(50, args.sessions // 8), args.window, spec, nb=64)
        if args.levers:
            out["engine_no_carry"] = engine_cost(args.sessions, args.window, 1, replace(spec, carry=False),
                                                 args.reps, bar=args.progress)
            out["engine_no_batch"] = engine_cost(args.sessions, args.window, 1, replace(spec, batch=False),
                                                 args.reps, bar=args.progress)
    if "scale" in parts:
        small = PairSpec(block_nbytes=4 * KIB, fake=args.fake)
        out["scale"] = scale([(100, 100), (args.scale_live, args.scale_fences)], args.probe, args.scale_reps, small,
                             args.progress)
    if "fence" in parts:
        out["fence"] = fence(args.fence_ids, args.seed)
    if "levers" in parts:
        out["levers"] = levers(20000 if not args.quick else 2000, spec)
    if "w4" in parts:
        out["w4"] = w4([16, 32, 64, 128, 256], args.w4_mib * (1 << 20), args.w4_sessions, spec, args.progress)
    return out


def report(r: dict[str, Any]) -> None:
    e = r["environment"]
    print(f"cost  python {e['python']} (libpython {e.get('libpython', '?')})  nixl {e['nixl']}  "
          f"ucx {e['ucx']}  cpus={e['cpus']}  load={e['loadavg'][0]}")
    for key in ("engine", "engine_4mib", "engine_no_carry", "engine_no_batch"):
        if key in r:
            m = r[key]
            print(f"  {key:16s} {m['blocks']:3d} x {m['block_nbytes'] // KIB} KiB: sender {m['sender_cpu_us']:7.1f} us"
                  f"  receiver {m['receiver_cpu_us']:7.1f} us per session (CPU)  wall {m['wall_us']:7.1f} us  "
                  f"frames {m['control_frames']:.2f} ({m['control_messages']:.2f} msgs)  steps "
                  f"{m['sender_steps']:.1f}/{m['receiver_steps']:.1f}  gc {m['gc_us']:.1f} us "
                  f"({m['gc_full_collections']} full)")
    if "levers" in r:
        lv = r["levers"]
        print(f"  levers: HMAC {lv['hmac_new_ns']} -> {lv['hmac_precomputed_ns']} ns; recorder {lv['recorder_old_ns']} -> "
              f"{lv['recorder_note_ns']} ns; encode {lv['encode_old_ns']} -> {lv['encode_ns']} ns, decode "
              f"{lv['decode_ns']} ns; 64 messages: 64 frames {lv['encode_64_frames_ns']} ns vs one "
              f"{lv['encode_64_messages_one_frame_ns']} ns")
        print(f"    handle {lv['handle_old_ns']} -> {lv['handle_ns']} ns; Python calls per session "
              f"{lv['python_calls_per_session']}")
        for mode, b in lv["burst"].items():
            print(f"    burst of {b['publications']} publications, {mode}: {b['frames']} frames, "
                  f"{b['cpu_us_per_publication']} us CPU each")
    for key, label in (("engine_breakdown", "breakdown"), ("engine_breakdown_4mib", "4 MiB")):
        for side, b in r.get(key, {}).items():
            print(f"  {side:8s} {label}: {b['engine_cpu_us']} us = NIXL calls {b['nixl_cpu_us']} us "
                  f"({', '.join(f'{k} {v}' for k, v in b['nixl_us_by_call'].items())}) + Python {b['python_cpu_us']} us")
    if "scale" in r:
        for p in r["scale"]["points"]:
            print(f"  scale live={p['live']:6d} fences={p['fences']:8d}: {p['cost_us']:7.1f} us/session "
                  f"(both sides) runs {p['cost_us_runs']}")
        print(f"  scale_cost_ratio {r['scale']['scale_cost_ratio']} (target <= 1.5: "
              f"{'met' if r['scale']['met'] else 'NOT met'})")
    if "w4" in r:
        print("  W4 descriptor sweep: tokens/block blocks descs  kvown CPU us  raw post->DONE us  overhead us")
        for p in r["w4"]["points"]:
            print(f"    {p['tokens_per_block']:4d} {p['blocks']:5d} {p['descriptors']:5d}  {p['kvown_cpu_us']:9.1f}  "
                  f"{p['raw_post_to_done_us']:9.1f}  {p['kvown_overhead_us']:9.1f}")
    if "fence" in r:
        f = r["fence"]
        print(f"  fence {f['ids']} ids: {f['fence_bytes_per_id']} B/id (tracemalloc {f['fence_tracemalloc_bytes_per_id']};"
              f" dict {f['dict_tracemalloc_bytes_per_id']}), hit {f['fence_hit_ns']} ns, miss {f['fence_miss_ns']} ns")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvown bench cost", description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="engine,scale,fence,w4,levers",
                    help="comma list of engine, scale, fence, w4, levers")
    ap.add_argument("--sessions", type=count, default=2000)
    ap.add_argument("--window", type=count, default=4)
    ap.add_argument("--reps", type=count, default=3)
    ap.add_argument("--levers", action="store_true", help="also run with carried results / batch frames off")
    ap.add_argument("--probe", type=count, default=1000, help="sessions measured at each scale level")
    ap.add_argument("--scale-live", type=count, default=10_000)
    ap.add_argument("--scale-fences", type=count0, default=1_000_000)
    ap.add_argument("--scale-reps", type=count, default=3)
    ap.add_argument("--fence-ids", type=count, default=1_000_000)
    ap.add_argument("--w4-mib", type=count, default=16, help="bytes per W4 session (MiB)")
    ap.add_argument("--w4-sessions", type=count, default=40)
    ap.add_argument("--fake", action="store_true", help="the fake NIXL library instead of real NIXL")
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty())
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG: lever ratios, scale and W4 bars")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.parts.split(",")) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {', '.join(unknown)} (choose from {', '.join(PARTS)})")
    if args.quick:
        args.sessions, args.reps, args.probe, args.scale_reps = 200, 1, 200, 1
        args.scale_live, args.scale_fences, args.fence_ids = 2000, 100_000, 100_000
        args.w4_mib, args.w4_sessions = 4, 5
    result = run(args)
    return emit(result, args, report, plot)


def plot(r: dict[str, Any], path: str) -> None:
    """Ratio bars: each lever after / before; scale cost per level; W4 CPU per session by block size."""
    import numpy as np

    from kvown.apps.benchmarks.common import plot_figure, save

    fig, axes = plot_figure(path, 3, f"kvown bench cost ({r['environment']['date']}, load {r['environment']['loadavg'][0]})")
    lv = r.get("levers")
    if lv:
        pairs = [("HMAC", lv["hmac_new_ns"], lv["hmac_precomputed_ns"]),
                 ("recorder", lv["recorder_old_ns"], lv["recorder_note_ns"]),
                 ("encode", lv["encode_old_ns"], lv["encode_ns"]),
                 ("handle", lv["handle_old_ns"], lv["handle_ns"]),
                 ("64 msgs", lv["encode_64_frames_ns"], lv["encode_64_messages_one_frame_ns"])]
        names = [p[0] for p in pairs]
        axes[0].bar(np.arange(len(pairs)), [p[2] / p[1] for p in pairs], color="tab:green")
        axes[0].axhline(1.0, color="black", lw=1)
        axes[0].set_xticks(np.arange(len(pairs)), names, fontsize=8)
        axes[0].set_ylabel("after / before (per call)")
        axes[0].set_title("levers")
    if "scale" in r:
        pts = r["scale"]["points"]
        axes[1].bar([f"{p['live']} live\n{p['fences']} fences" for p in pts], [p["cost_us"] for p in pts])
        axes[1].set_ylabel("us per session, both sides")
        axes[1].set_title(f"scale: ratio {r['scale']['scale_cost_ratio']} (target 1.5)")
    if "w4" in r:
        pts = r["w4"]["points"]
        for scattered, color in ((False, "tab:blue"), (True, "tab:orange")):
            sel = [p for p in pts if p["scattered"] is scattered]
            axes[2].plot([p["tokens_per_block"] for p in sel], [p["kvown_cpu_us"] for p in sel], "o-", color=color,
                         label="scattered (1 descriptor / block)" if scattered else "contiguous (1 descriptor)")
        axes[2].set_xscale("log", base=2)
        axes[2].set_xlabel("tokens per block")
        axes[2].set_ylabel("kvown CPU us per session")
        axes[2].set_title("W4 descriptor sweep")
        axes[2].legend(fontsize=7)
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
