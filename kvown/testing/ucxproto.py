"""Read ``UCX_PROTO_INFO=y`` output: which transports UCX really chose, per rank and per pair of ranks.

Owns: parsing UCX's protocol tables and turning them into facts a qualification can check.

With ``UCX_PROTO_INFO=y`` every UCX worker prints, the first time it uses a protocol on an endpoint
configuration, a table such as::

    [1796135386.684120] [hostA:7278 :0]   | kvown-5682f010-r1 inter-node cfg#1                       |
    [1796135386.684120] [hostA:7278 :0]   | remote memory write by ucp_put* from host memory to host |
    [1796135386.684120] [hostA:7278 :0]   | 0..inf | zero-copy   | tcp/eth0                          |

The prefix names the process (host, pid); the header names the worker, UCX's own class of the
configuration (``self``, ``intra-node``: it has a shared-memory lane, ``inter-node``: it has none) and
its index; the rows name the lanes as ``transport/device``.

Rules:
  1. UCX prints per endpoint *configuration*, not per peer. A pair (i -> j) is attributed exactly when
     rank i has no peer on its own host (then every non-self configuration of rank i serves other
     hosts). Otherwise the pair's candidates are rank i's configurations of the matching class, and the
     pair is marked ``exact: False``.
  2. A pair between hosts passes only with at least one network lane and no shared-memory lane among
     its candidates; no table at all is a failure (no evidence is not proof).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

# Lanes that move bytes between hosts, lanes that only work inside one host (shared memory / kernel
# copies between processes), and lanes that stay inside one process (no pair is judged by them).
NETWORK = frozenset(
    {
        "tcp",
        "rc",
        "rc_verbs",
        "rc_mlx5",
        "dc",
        "dc_mlx5",
        "ud",
        "ud_verbs",
        "ud_mlx5",
        "ib",
        "srd",
        "gga",
        "gga_mlx5",
    }
)
SHARED_MEMORY = frozenset({"cma", "posix", "sysv", "xpmem", "knem", "cuda_ipc", "rocm_ipc", "mm"})
IN_PROCESS = frozenset({"self", "cuda_copy", "gdr_copy", "rocm_copy", "rocm_gdr", "ze_copy"})

_PREFIX = re.compile(r"^\[[\d.]+\]\s+\[(?P<host>[^:\]\s]+):(?P<pid>\d+)\s*:\s*\d+\]\s+(?P<rest>.*)$")
_HEADER = re.compile(
    r"^\|\s*(?P<worker>\S+)\s+(?P<cls>self|intra-node|inter-node)\s+cfg#(?P<index>\d+)\s*\|$"
)
_LANE = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_.:-]+)")


@dataclasses.dataclass
class EndpointConfig:
    """One UCX endpoint configuration of one process, as printed."""

    worker: str
    cls: str  # "self" | "intra-node" | "inter-node"
    index: int
    lanes: set[str] = dataclasses.field(default_factory=set)


def parse(text: str) -> dict[tuple[str, int], dict[int, EndpointConfig]]:
    """{(host, pid): {cfg index: EndpointConfig}} from captured output (any interleaving of ranks)."""
    out: dict[tuple[str, int], dict[int, EndpointConfig]] = {}
    current: dict[tuple[str, int], EndpointConfig] = {}
    for raw in text.splitlines():
        m = _PREFIX.match(raw.strip())
        if not m:
            continue
        proc = (m["host"], int(m["pid"]))
        rest = m["rest"].strip()
        header = _HEADER.match(rest)
        if header:
            configs = out.setdefault(proc, {})
            index = int(header["index"])
            current[proc] = configs.setdefault(index, EndpointConfig(header["worker"], header["cls"], index))
            continue
        cfg = current.get(proc)
        if cfg is None or not rest.startswith("|"):
            continue
        cells = [c.strip() for c in rest.strip("|").split("|")]
        if len(cells) >= 3:  # Range | Description | Config: lanes live in the last column
            cfg.lanes.update(f"{t}/{d}" for t, d in _LANE.findall(cells[-1]))
    return out


def transport_kind(lane: str) -> str:
    name = lane.split("/", 1)[0]
    if name in NETWORK:
        return "network"
    if name in SHARED_MEMORY:
        return "shared-memory"
    if name in IN_PROCESS:
        return "in-process"
    return "unknown"


def all_lanes(parsed: dict[tuple[str, int], dict[int, EndpointConfig]]) -> list[str]:
    return sorted({lane for configs in parsed.values() for cfg in configs.values() for lane in cfg.lanes})


def pair_transports(
    parsed: dict[tuple[str, int], dict[int, EndpointConfig]],
    ranks: Sequence[dict],
    pairs: Iterable[Sequence[int]],
    *,
    require_device: str | None = None,
) -> dict[str, dict]:
    """For each (i, j) in ``pairs``: the lanes UCX used from rank i to rank j, and whether that is fine.

    ``ranks`` lists {"rank", "host", "pid"} per rank. ``require_device`` (e.g. "eth0" on test hosts)
    additionally demands that every network lane is ``tcp/<device>``. Rule 1 and rule 2.
    """
    by_rank = {int(r["rank"]): r for r in ranks}
    out = {}
    for i, j in pairs:
        a, b = by_rank.get(int(i)), by_rank.get(int(j))
        key = f"{i}->{j}"
        if a is None or b is None:
            out[key] = {"ok": False, "why": "rank not reported"}
            continue
        configs = [c for c in parsed.get((a["host"], int(a["pid"])), {}).values() if c.cls != "self"]
        cross = a["host"] != b["host"]
        same_host_peers = [r for r in ranks if r["host"] == a["host"] and int(r["rank"]) != int(i)]
        other_host_peers = [r for r in ranks if r["host"] != a["host"]]
        if cross and not same_host_peers or not cross and not other_host_peers:
            candidates, exact = configs, True
        else:
            wanted = "inter-node" if cross else "intra-node"
            candidates, exact = [c for c in configs if c.cls == wanted] or configs, False
        lanes = sorted({lane for c in candidates for lane in c.lanes})
        kinds = {transport_kind(lane) for lane in lanes}
        ok, why = True, ""
        if not lanes:
            ok, why = False, "no UCX_PROTO_INFO table from this rank"
        elif cross and "shared-memory" in kinds:
            ok, why = False, "a shared-memory transport between different hosts"
        elif cross and "network" not in kinds:
            ok, why = False, "no network transport between different hosts"
        elif (
            cross
            and require_device
            and any(transport_kind(lane) == "network" and lane != f"tcp/{require_device}" for lane in lanes)
        ):
            ok, why = False, f"a network lane other than tcp/{require_device}"
        out[key] = {
            "from_host": a["host"],
            "to_host": b["host"],
            "cross_host": cross,
            "lanes": lanes,
            "ucx_class": sorted({c.cls for c in candidates}),
            "exact": exact,
            "ok": ok,
            "why": why,
        }
    return out
