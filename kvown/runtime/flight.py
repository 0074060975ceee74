"""Flight recorder: the last N protocol events of one rank, written to a file when the rank fail-stops.

Owns: the per-rank event ring and the dump file format (JSON lines); ``kvown inspect FILE``
(``kvown.apps.inspect``) reads it.

Rules:
  1. ``record`` is cheap and safe from any thread: one clock read, one tuple, one ``deque.append``
     (atomic under the GIL, and the ring drops its oldest event when full). It never logs, never
     blocks and never raises on odd detail values (they are ``repr``'d at dump time, not here).
  2. ``dump`` never uses ``logging`` (the fail-stop path may run while a logger is wedged) and takes
     no lock that ``record`` holds: it copies the ring with ``deque.copy`` (one C call under the GIL).
  3. The dump is written in order header, events (oldest first), stacks, so a dump cut short by the
     kill still starts with the reason.

Invariants:
  INV-FR1  The ring never holds more than ``capacity`` events; ``dropped`` counts what fell out.
  INV-FR2  A dump file names the rank, pid, reason and, where known, the fatal request id.
  INV-FR3  File name is ``kvown-flight-rank{R}-pid{P}.jsonl``, so ranks of one job never collide.

File format (one JSON object per line):
  {"type": "header", "rank", "pid", "reason", "request_id", "detail", "wall_time_s", "mono_ns",
   "capacity", "dropped"}
  {"type": "event", "t_ns", "kind", "request_id", "detail": {...}}       t_ns is ``time.monotonic_ns``
  {"type": "stack", "thread_id", "thread_name", "daemon", "frames": ["file:line in func", ...]}
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from kvown.core.actions import FatalReason

FLIGHT_DIR_ENV = "KVOWN_FLIGHT_DIR"
DEFAULT_CAPACITY = 4096


def flight_file_name(rank: int, pid: int) -> str:
    return f"kvown-flight-rank{rank}-pid{pid}.jsonl"


def default_flight_dir() -> Path:
    """``$KVOWN_FLIGHT_DIR`` if set and non-empty, else the current directory."""
    return Path(os.environ.get(FLIGHT_DIR_ENV) or os.getcwd())


def thread_stacks() -> list[dict[str, Any]]:
    """Every live thread's Python stack, innermost frame last.

    Called: by ``dump`` and the hang detector, from whichever thread reports (never the one it inspects
    only). After error: a thread that vanishes mid-walk is simply missing from the result.
    """
    threads = {t.ident: t for t in threading.enumerate()}
    stacks = []
    for ident, frame in sys._current_frames().items():
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


class FlightRecorder:
    """Bounded ring of recent protocol events of one rank."""

    def __init__(
        self,
        rank: int,
        *,
        capacity: int = DEFAULT_CAPACITY,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.rank = rank
        self.capacity = capacity
        self._clock_ns = clock_ns
        self._ring: collections.deque[tuple[int, str, int | None, dict[str, Any]]] = collections.deque(
            maxlen=capacity
        )
        self._recorded = 0  # racy counter, only used to report how many events fell out

    def record(self, kind: str, request_id: int | None, **detail: Any) -> None:
        """Append one event (e.g. ``record("publish", 7, dst_rank=1, deadline_ns=...)``).

        Called: often, from any thread (engine, pollers). Cheap: one clock read and one append.
        After error: cannot fail short of MemoryError.
        """
        self._ring.append((self._clock_ns(), kind, request_id, detail))
        self._recorded += 1

    def events(self) -> list[tuple[int, str, int | None, dict[str, Any]]]:
        """A snapshot of the ring, oldest first. Called: by dumps and tests, any thread."""
        return list(self._ring.copy())

    @property
    def dropped(self) -> int:
        return max(0, self._recorded - len(self._ring))

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
            "capacity": self.capacity,
            "dropped": self.dropped,
        }
        with open(target, "w", encoding="utf-8") as f:
            f.write(json.dumps(header) + "\n")
            for t_ns, kind, rid, det in self.events():
                line = {"type": "event", "t_ns": t_ns, "kind": kind, "request_id": rid, "detail": det}
                f.write(json.dumps(line, default=repr) + "\n")
            if include_stacks:
                for stack in thread_stacks():
                    f.write(json.dumps(stack, default=repr) + "\n")
        return target


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
