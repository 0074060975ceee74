"""Helpers every workload shares: percentiles, the environment record, progress bars, JSON, plots.

Rules:
  1. Timings are integer nanoseconds from ``time.perf_counter_ns`` / ``time.monotonic_ns`` on one host;
     reports are microseconds, rounded to 0.1.
  2. The environment record names what a figure depends on: machine, CPU count and load, Python,
     torch, NIXL, UCX (version and the transports NIXL picked), MPI, and the ``UCX_*`` settings.
  3. Progress bars (tqdm, pinned) go to stderr and only when asked (``progress=True``), so a JSON on
     stdout or a CI log stays clean.
"""

from __future__ import annotations

import ctypes
import datetime
import glob
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Iterable

import numpy as np

import kvown

KIB, MIB = 1024, 1 << 20


def pct(values_ns: Iterable[int] | np.ndarray) -> dict[str, float]:
    """p50/p90/p99/p99.9/max/mean in microseconds and the sample count."""
    us = np.asarray(list(values_ns) if not isinstance(values_ns, np.ndarray) else values_ns, dtype=np.float64) / 1e3
    if us.size == 0:
        return {"n": 0}
    q = np.percentile(us, [50, 90, 99, 99.9])
    return {"n": int(us.size), "p50_us": round(float(q[0]), 1), "p90_us": round(float(q[1]), 1),
            "p99_us": round(float(q[2]), 1), "p999_us": round(float(q[3]), 1),
            "max_us": round(float(us.max()), 1), "mean_us": round(float(us.mean()), 1)}


def count(text: str) -> int:
    """argparse ``type=``: a positive int (sessions, repetitions, a window); refuses 0 and below by name."""
    return _int_at_least(text, 1)


def count0(text: str) -> int:
    """argparse ``type=``: an int >= 0 (warm-up sessions, fences to pre-install)."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} (at least {low})")
    return value


def size_name(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else f"{n // KIB} KiB"


def ucx_version() -> str:
    """The version of the UCX library NIXL loaded (bundled in the nixl wheel), or 'unknown'."""
    import nixl  # noqa: F401 - loads the bundled libucp

    for lib in _ucx_libs():
        try:
            fn = ctypes.CDLL(lib).ucp_get_version_string
            fn.restype = ctypes.c_char_p
            return fn().decode()
        except (OSError, AttributeError):
            continue
    return "unknown"


def _ucx_libs() -> list[str]:
    roots = set()
    for name in list(sys.modules):
        if name.startswith("nixl"):
            f = getattr(sys.modules[name], "__file__", None)
            if f:
                roots.add(os.path.dirname(os.path.dirname(f)))
    out = []
    for root in roots:
        out += glob.glob(os.path.join(root, "nixl*.libs", "libucp*.so*"))
        out += glob.glob(os.path.join(root, "nixl*", "**", "libucp*.so*"), recursive=True)
    return out


def ucx_transports(timeout_s: float = 60.0) -> dict[str, Any]:
    """The UCX lanes NIXL really uses here for kvown's two paths - the WRITE (``ucp_put``) and the
    notifications (active messages) - read from ``UCX_PROTO_INFO=y`` in a child process that posts one
    WRITE with a notification and sends one notification between two agents."""
    import subprocess

    env = dict(os.environ, UCX_PROTO_INFO="y", NIXL_LOG_LEVEL="WARN")
    code = "from kvown.apps.benchmarks.common import _probe_child; _probe_child()"
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return {"write": "unknown", "notifications": "unknown", "error": repr(exc)}
    return _parse_proto_info(out)


def _parse_proto_info(text: str) -> dict[str, Any]:
    import re

    lanes: dict[str, set[str]] = {"write": set(), "notifications": set()}
    title = ""
    for line in text.splitlines():
        body = line.split("]", 2)[-1].strip() if line.startswith("[") else line.strip()
        if not body.startswith("|"):
            continue
        cells = [c.strip() for c in body.strip("|").split("|")]
        if len(cells) == 1:
            title = cells[0]
            continue
        if len(cells) >= 3 and cells[0] not in ("Range",):
            found = re.findall(r"\b([a-z][a-z0-9_]*/[A-Za-z0-9_.:-]+)", cells[-1])
            if "remote memory write" in title:
                lanes["write"].update(found)
            elif "active message" in title:
                lanes["notifications"].update(found)
    return {k: ", ".join(sorted(v)) or "unknown" for k, v in lanes.items()}


def _probe_child() -> None:
    """Child of ``ucx_transports``: two agents in one process, one WRITE + notification, one notification."""
    from kvown.adapters.nixl import MemKind, NixlEndpoint, XferStatus

    a, b = NixlEndpoint(f"probe-a-{os.getpid()}"), NixlEndpoint(f"probe-b-{os.getpid()}")
    src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
    a.register(src.ctypes.data, src.nbytes, MemKind.DRAM)
    b.register(dst.ctypes.data, dst.nbytes, MemKind.DRAM)
    a.add_peer(b.metadata())
    b.add_peer(a.metadata())
    h = a.post_write(b.name, [(src.ctypes.data, 1 << 20)], [(dst.ctypes.data, 1 << 20)], MemKind.DRAM, notif=b"w")
    for _ in range(100_000):
        if a.poll(h) is not XferStatus.IN_PROGRESS:
            break
        b.drain_notifs()
    a.release(h)
    a.send_notif(b.name, b"n")
    for _ in range(10_000):
        if b.drain_notifs():
            break
    a.close()
    b.close()


def environment(seed: int | None = None) -> dict[str, Any]:
    import importlib.metadata as md

    def ver(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "-"

    import torch

    build = kvown.build_info()  # one read of the imports and of /proc/self/maps
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.system()} {platform.release()}",
        "cpu": _cpu_model(), "cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(), "torch": torch.__version__, "nixl": ver("nixl"),
        "kvown": ver("kvown"), "msgpack": ver("msgpack"), "numpy": ver("numpy"), "mpi4py": ver("mpi4py"),
        "ucx": ucx_version(), "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "nixl_progress_thread": False, "memory": "DRAM (CPU)", "gpu": _gpu(),
        "kvown_build": build["build"],  # compiled (mypyc) / interpreted hot path
        "python_executable": build["interpreter"]["executable"],
        "libpython": build["interpreter"]["libpython"],  # shared / static (build.py rule 3)
    }
    try:
        from mpi4py import MPI

        env["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    except Exception:  # noqa: BLE001
        env["mpi"] = "-"
    if seed is not None:
        env["seed"] = seed
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _gpu() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception:  # noqa: BLE001
        return "none"


def progress(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr, or a do-nothing stand-in."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True, mininterval=0.5)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def emit(result: dict[str, Any], args: Any, report: Any, plot: Any) -> int:
    """How every workload's ``main`` ends: print its report, write ``--json``, draw ``--plot``; exit 0."""
    report(result)
    write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return 0


def write_json(path: str | os.PathLike[str] | None, obj: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(obj, indent=1, default=_plain) + "\n")


def _plain(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    return repr(value)


def plot_figure(path: str | os.PathLike[str], ncols: int, title: str) -> tuple[Any, Any]:
    """A matplotlib figure of ``ncols`` panels (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4.3), squeeze=False)
    fig.suptitle(title, fontsize=10)
    return fig, axes[0]


def cdf(ax: Any, samples_us: Iterable[float], label: str, **kw: Any) -> None:
    us = np.sort(np.asarray(list(samples_us), dtype=np.float64))
    if us.size:
        ax.plot(us, np.arange(1, us.size + 1) / us.size, label=label, **kw)


def w1_bars(ax: Any, rows: list[dict[str, Any]]) -> None:
    """W1's kvown / raw ratios per size: the event-driven consumer (the headline) beside the thread one,
    and B0+pub's own ratio to raw as a mark (where a protocol that publishes could reach)."""
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [row["ratio"] for row in rows], 0.4, color="tab:blue", label="callbacks (headline)")
    if all("ratio_threads" in row for row in rows):
        ax.bar(x + 0.2, [row["ratio_threads"] for row in rows], 0.4, color="tab:gray", label="waiting thread")
    if all("raw_pub_over_raw" in row for row in rows):  # B0+pub: the ceiling of a protocol that publishes
        ax.scatter(x, [row["raw_pub_over_raw"] for row in rows], marker="_", s=600, color="black", zorder=3,
                   label="B0+pub / raw (publication only)")
    ax.axhline(0.95, color="tab:red", ls="--", lw=1, label="target 0.95 (>= 4 MiB)")
    ax.axhline(0.8, color="tab:orange", ls=":", lw=1, label="target 0.8 (1 MiB)")
    ax.set_xticks(x, [size_name(row["size"]) for row in rows])
    ax.set_ylabel("kvown / raw NIXL throughput")
    ax.set_ylim(0, max(1.4, ax.get_ylim()[1]))  # headroom for the legend above the bars
    ax.legend(fontsize=6, loc="upper left", ncol=2)


def save(fig: Any, path: str | os.PathLike[str]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
