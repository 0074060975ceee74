"""Flight recorder: the last N protocol events of one rank, written to a file when the rank fail-stops.

Owns: the per-rank event ring and the dump file format (JSON lines); ``kvown inspect FILE``
(``kvown.apps.inspect``) reads it.

Rules:
  1. Recording is cheap and safe from any thread: one slot index from ``itertools.count`` (atomic
     under the GIL), one clock read, one tuple store into a preallocated ring. ``note(code, rid, ...)``
     stores plain values under an integer code (names in ``EVENT_FIELDS``), ``record(kind, rid,
     **detail)`` a dict (cold paths); formatting waits for the dump; recording never logs or raises.
  2. ``dump`` never uses ``logging`` (the fail-stop path may run while a logger is wedged) and takes
     no lock that recording holds: it copies the ring (one C-level list copy under the GIL) and
     formats the copy.
  3. The dump is written header, open sessions (``state_source``: a failure there is one line), events
     (oldest first), stacks: a dump cut short by the kill still starts with the reason and the claims.
  4. Stacks are read through ``current_frames``, never ``sys._current_frames`` (a GC inside it can
     deadlock CPython 3.11 with the GIL held).

Invariants:
  INV-FR1  The ring never holds more than ``capacity`` events; ``dropped`` counts what fell out.
  INV-FR2  A dump file names the rank, pid, reason and, where known, the fatal request id.
  INV-FR3  File name is ``kvown-flight-rank{R}-pid{P}.jsonl``, so ranks of one job never collide.
File format (JSON lines: header, open_session, event, stack): docs/design.md section 14.
"""

from __future__ import annotations

import enum
import gc
import itertools
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any, Callable

from kvown.core.actions import FatalReason

FLIGHT_DIR_ENV = "KVOWN_FLIGHT_DIR"
DEFAULT_CAPACITY = 4096


def flight_file_name(rank: int, pid: int) -> str:
    return f"kvown-flight-rank{rank}-pid{pid}.jsonl"


def clock_identity() -> str | None:
    """What another rank's ``time.monotonic_ns`` must match to be the same clock: this boot
    (``/proc/sys/kernel/random/boot_id``) and this time namespace's monotonic offset. None where /proc
    does not say. Called: once per dump."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    offset = "0 0"  # no timens_offsets file: a kernel without time namespaces
    try:
        for line in Path("/proc/self/timens_offsets").read_text().splitlines():
            name, *value = line.split()
            if name == "monotonic":
                offset = " ".join(value)
    except (OSError, ValueError):
        pass
    return f"monotonic boot {boot} offset {offset}"


def default_flight_dir() -> Path:
    """``$KVOWN_FLIGHT_DIR`` if set and non-empty, else the current directory."""
    return Path(os.environ.get(FLIGHT_DIR_ENV) or os.getcwd())


_FRAMES_LOCK = threading.Lock()  # serialises the GC pause below between reporting threads


def current_frames() -> dict[int, FrameType]:
    """``sys._current_frames()`` with the cyclic garbage collector paused.

    Why: on CPython 3.11 that call allocates frame objects while holding the runtime's thread-list
    lock; an allocation can start a collection, and a collected ``threading.local`` takes the same lock
    to clean up: the calling thread deadlocks on itself with the GIL held, so every thread of the
    process stops, the kill path included (cpython gh-106883; 3.12 fixed it). Two fail-stop
    executors dumping at once in one process hung that way in a test run. The lock keeps one
    reporter from re-enabling the collector while another is inside the call.
    Called: by ``thread_stacks``, any thread. After error: the collector is restored as it was.
    """
    with _FRAMES_LOCK:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return sys._current_frames()
        finally:
            if was_enabled:
                gc.enable()


def thread_stacks() -> list[dict[str, Any]]:
    """Every live thread's Python stack, innermost frame last.

    Called: by ``dump`` and the hang detector, from whichever thread reports (never the one it inspects
    only). After error: a thread that vanishes mid-walk is simply missing from the result.
    """
    threads = {t.ident: t for t in threading.enumerate()}
    stacks = []
    for ident, frame in current_frames().items():
        thread = threads.get(ident)
        frames = [f"{fs.filename}:{fs.lineno} in {fs.name}" for fs in traceback.extract_stack(frame)]
        stacks.append(
            {
                "type": "stack",
                "thread_id": ident,
                "thread_name": thread.name if thread else "?",
                "daemon": bool(thread.daemon) if thread else None,
                "frames": frames,
            }
        )
    return stacks


# Hot-path event codes (``note``): code -> (kind, names of the positional values a, b, c, d).
EVENT_FIELDS: dict[int, tuple[str, tuple[str, ...]]] = {}


def event_code(kind: str, *names: str) -> int:
    """Register a hot-path event kind once (module import time); returns its code for ``note``."""
    for code, (k, n) in EVENT_FIELDS.items():
        if k == kind:
            if n != names:
                raise ValueError(f"event {kind!r} registered twice with different fields")
            return code
    code = len(EVENT_FIELDS) + 1
    EVENT_FIELDS[code] = (kind, names)
    return code


def _entry(e: tuple[Any, ...]) -> tuple[int, str, int | None, dict[str, Any]]:
    """Format one stored entry (off the hot path): ``(t_ns, kind, request_id, detail)``; an enum value
    (a message kind, an outcome) reads as its name."""
    _, t_ns, code, rid, a, b, c, d = e
    if type(code) is int:
        kind, names = EVENT_FIELDS[code]
        return t_ns, kind, rid, {n: v.name if isinstance(v, enum.Enum) else v for n, v in zip(names, (a, b, c, d))}
    return t_ns, code, rid, a  # record(): the kind string and its detail dict


class FlightRecorder:
    """Bounded ring of recent protocol events of one rank (module rules 1 and 2)."""

    def __init__(
        self,
        rank: int,
        *,
        capacity: int = DEFAULT_CAPACITY,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if type(capacity) is not int or capacity <= 0:
            raise ValueError("capacity must be a positive int")
        self.rank = rank
        self.capacity = capacity
        self._clock_ns = clock_ns
        self._ring: list[Any] = [None] * capacity  # slot i % capacity holds event number i
        self._count = itertools.count()
        self._last = -1  # number of the newest event: a hint for ``events_since`` (racy across threads)
        self.state_source: Callable[[], list[dict[str, Any]]] | None = None  # rule 3: open sessions

    def note(self, code: int, request_id: int | None, a: Any = None, b: Any = None, c: Any = None,
             d: Any = None) -> None:
        """Append one hot-path event: ``code`` from ``event_code`` and up to four plain values.

        Called: per protocol event on the engine thread (and from any thread). Costs one counter step,
        one clock read and one tuple store; nothing is formatted. After error: cannot fail.
        """
        i = next(self._count)
        self._ring[i % self.capacity] = (i, self._clock_ns(), code, request_id, a, b, c, d)
        self._last = i

    def record(self, kind: str, request_id: int | None, **detail: Any) -> None:
        """Append one event with a free-form detail (``record("publish", 7, dst_rank=1)``).

        Called: on cold paths (errors, fail-stops, tests), any thread. After error: cannot fail short
        of MemoryError.
        """
        i = next(self._count)
        self._ring[i % self.capacity] = (i, self._clock_ns(), kind, request_id, detail, None, None, None)
        self._last = i

    @property
    def recorded(self) -> int:
        """How many events were recorded since the start (kept or dropped). Read off the ring (the
        newest slot's event number), so the hot path keeps no second counter."""
        return 1 + max((e[0] for e in self._ring.copy() if e is not None), default=-1)

    def events(self) -> list[tuple[int, str, int | None, dict[str, Any]]]:
        """Every event in the ring, oldest first, as ``(t_ns, kind, request_id, detail)``.

        Called: by dumps and tests, any thread (formats here, off the hot path).
        """
        snapshot = self._ring.copy()  # rule 2: one C-level copy; records racing it land in the ring
        return [_entry(e) for e in sorted((e for e in snapshot if e is not None), key=lambda e: e[0])]

    def events_since(self, number: int) -> tuple[int, list[tuple[int, str, int | None, dict[str, Any]]]]:
        """``(next_number, events numbered >= number still in the ring)``, oldest first.

        Called: by a reader that follows the ring step by step on the recording thread (the simulator's
        oracles); cost is proportional to the new events, not to the capacity.
        """
        hi = self._last + 1
        out = []
        for i in range(max(number, hi - self.capacity), hi):
            e = self._ring[i % self.capacity]
            if e is not None and e[0] == i:
                out.append(_entry(e))
        return max(hi, number), out

    @property
    def dropped(self) -> int:
        return max(0, self.recorded - self.capacity)

    def dump(
        self,
        path_or_dir: str | os.PathLike[str] | None,
        reason: FatalReason | str,
        include_stacks: bool = True,
        *,
        request_id: int | None = None,
        detail: str = "",
    ) -> Path:
        """Write this rank's ring (and every thread's stack) to a JSON-lines file and return its path.

        ``path_or_dir``: an existing directory (the file gets the standard name inside it), a file path,
        or None for ``default_flight_dir()``.
        Called: once per fail-stop, from the fail-stop executor's dump thread (bounded join), or by
        tests. Never logs. After error: raises ``OSError`` from the file system; the ring is unchanged.
        """
        target = Path(path_or_dir) if path_or_dir is not None else default_flight_dir()
        if target.is_dir():
            target = target / flight_file_name(self.rank, os.getpid())
        header = {
            "type": "header",
            "rank": self.rank,
            "pid": os.getpid(),
            "reason": reason.value if isinstance(reason, FatalReason) else str(reason),
            "request_id": request_id,
            "detail": detail,
            "wall_time_s": time.time(),
            "mono_ns": time.monotonic_ns(),
            "clock": clock_identity() if self._clock_ns is time.monotonic_ns else None,  # kvown.apps.hops
            "capacity": self.capacity,
            "dropped": self.dropped,
        }
        with open(target, "w", encoding="utf-8") as f:
            f.write(json.dumps(header) + "\n")
            for line in self._open_sessions():
                f.write(json.dumps(line, default=repr) + "\n")
            for t_ns, kind, rid, det in self.events():
                line = {"type": "event", "t_ns": t_ns, "kind": kind, "request_id": rid, "detail": det}
                f.write(json.dumps(line, default=repr) + "\n")
            if include_stacks:
                for stack in thread_stacks():
                    f.write(json.dumps(stack, default=repr) + "\n")
        return target


    def _open_sessions(self) -> list[dict[str, Any]]:
        if self.state_source is None:
            return []
        try:
            return [{"type": "open_session", **s} for s in self.state_source()]
        except Exception as exc:  # noqa: BLE001 - rule 3: the dump goes on
            return [{"type": "open_session_error", "error": repr(exc)}]


def read_flight_file(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Parse a dump; a truncated last line (the kill cut the write short) is ignored."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records
