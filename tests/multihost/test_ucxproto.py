"""Reading UCX_PROTO_INFO output (kvown.testing.ucxproto): per-rank configurations and per-pair verdicts."""

from __future__ import annotations

import itertools

from kvown.testing import ucxproto


def table(
    host: str,
    pid: int,
    worker: str,
    cls: str,
    index: int,
    lanes: list[str],
    what: str = "remote memory write",
) -> str:
    p = f"[1796135386.684120] [{host}:{pid} :0]   "
    rows = [
        f"{p}+--------+-------------+--------------+",
        f"{p}| {worker} {cls} cfg#{index}   |",
        f"{p}| {what} by ucp_put* from host memory to host |",
        f"{p}+--------+-------------+--------------+",
        f"{p}| Range  | Description |    Config    |",
    ]
    rows += [f"{p}| 0..inf | zero-copy   | {lane}     |" for lane in lanes]
    return "\n".join(rows) + "\n"


RANKS3 = [
    {"rank": 0, "host": "a", "pid": 10},
    {"rank": 1, "host": "b", "pid": 11},
    {"rank": 2, "host": "c", "pid": 12},
]
PAIRS = [(0, 2), (1, 2), (2, 0), (2, 1)]


def test_parse_groups_tables_by_process_and_configuration_even_when_interleaved():
    a = table("a", 10, "w-r0", "inter-node", 1, ["tcp/eth0"]).splitlines()
    b = table("b", 11, "w-r1", "intra-node", 2, ["cma/memory", "tcp/eth0"]).splitlines()
    text = (
        "\n".join(x for pair in itertools.zip_longest(a, b, fillvalue="") for x in pair)
        + "\nnoise | tcp/lo | not a table\n"
    )
    parsed = ucxproto.parse(text)
    assert parsed[("a", 10)][1].lanes == {"tcp/eth0"} and parsed[("a", 10)][1].cls == "inter-node"
    assert parsed[("b", 11)][2].lanes == {"cma/memory", "tcp/eth0"}
    assert ucxproto.all_lanes(parsed) == ["cma/memory", "tcp/eth0"]


def test_one_rank_per_host_over_tcp_is_exact_and_passes():
    text = "".join(table(r["host"], r["pid"], f"w{r['rank']}", "inter-node", 1, ["tcp/eth0"]) for r in RANKS3)
    text += table("a", 10, "w0", "self", 0, ["tcp/eth0"])
    pairs = ucxproto.pair_transports(ucxproto.parse(text), RANKS3, PAIRS, require_device="eth0")
    assert all(p["ok"] and p["exact"] and p["lanes"] == ["tcp/eth0"] for p in pairs.values()), pairs


def test_shared_memory_between_hosts_fails_the_pair():
    """What UCX does between namespace hosts without UCX_TLS: cma, because they share one kernel."""
    text = "".join(
        table(r["host"], r["pid"], f"w{r['rank']}", "intra-node", 1, ["cma/memory", "tcp/eth0"])
        for r in RANKS3
    )
    pairs = ucxproto.pair_transports(ucxproto.parse(text), RANKS3, PAIRS)
    assert not any(p["ok"] for p in pairs.values())
    assert "shared-memory" in pairs["0->2"]["why"]


def test_no_table_is_no_proof():
    pairs = ucxproto.pair_transports({}, RANKS3, PAIRS)
    assert not any(p["ok"] for p in pairs.values())


def test_a_network_lane_on_the_wrong_device_fails_where_the_device_is_required():
    text = "".join(table(r["host"], r["pid"], f"w{r['rank']}", "inter-node", 1, ["tcp/eth1"]) for r in RANKS3)
    parsed = ucxproto.parse(text)
    assert all(p["ok"] for p in ucxproto.pair_transports(parsed, RANKS3, PAIRS).values())
    assert not any(
        p["ok"] for p in ucxproto.pair_transports(parsed, RANKS3, PAIRS, require_device="eth0").values()
    )


def test_a_rank_with_peers_on_its_own_host_is_judged_by_its_inter_node_configurations_and_marked_inexact():
    ranks = [
        {"rank": 0, "host": "a", "pid": 10},
        {"rank": 1, "host": "b", "pid": 11},
        {"rank": 2, "host": "a", "pid": 12},
    ]
    text = table("a", 12, "w2", "intra-node", 1, ["cma/memory"]) + table(
        "a", 12, "w2", "inter-node", 2, ["rc_mlx5/mlx5_0:1"]
    )
    pairs = ucxproto.pair_transports(ucxproto.parse(text), ranks, [(2, 1), (2, 0)])
    assert (
        pairs["2->1"]["ok"] and not pairs["2->1"]["exact"] and pairs["2->1"]["lanes"] == ["rc_mlx5/mlx5_0:1"]
    )
    assert (
        pairs["2->0"]["ok"] and not pairs["2->0"]["cross_host"] and pairs["2->0"]["lanes"] == ["cma/memory"]
    )
