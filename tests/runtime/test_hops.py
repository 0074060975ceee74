"""``kvown inspect --hops``: where sessions' time went, across the flight dumps of a world's ranks.

Synthetic dumps pin the matching rules (``kvown.apps.hops`` rules 1-3), each with a mutant that the
same check catches; a real two-rank world over NIXL shows the table on real dumps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvown.apps import hops
from kvown.apps.hops import Dump, hop_report
from kvown.apps.inspect import inspect_main
from kvown.runtime.flight import clock_identity

CLOCK = "monotonic boot test offset 0 0"


def _ev(t_ns: int, kind: str, rid: int | None, **detail: object) -> dict[str, object]:
    return {"type": "event", "t_ns": t_ns, "kind": kind, "request_id": rid, "detail": detail}


def _two_way(clock_1: str | None = CLOCK) -> list[Dump]:
    """Rank 0 receives request 7 from writer 1. Both directions use seq 0, so a frame is only found by
    (src, dst, seq): REQUEST_DATA 0 -> 1 takes 40 us, the ack 1 -> 0 takes 25 us, the carried report
    lands 300 us after its post."""
    r0 = [_ev(1_000_000, "open_receive", 7), _ev(1_010_000, "send", 7, dst=1, seq=0, msgs=1),
          _ev(1_400_000, "recv_carried", 7, msg="KV_RESULT", src=1, piece=0),
          _ev(1_500_000, "recv", 7, msg="SESSION_QUIESCED", src=1, seq=0, index=0)]
    r1 = [_ev(1_050_000, "recv", 7, msg="REQUEST_DATA", src=0, seq=0, index=0),
          _ev(1_100_000, "post", 7, op=3, dst=0, carried=True), _ev(1_300_000, "post_returned", 7, op=3),
          _ev(1_475_000, "send", 7, dst=0, seq=0, msgs=1)]
    return [Dump(0, 100, CLOCK, r0), Dump(1, 101, clock_1, r1)]


def _figures(report: dict) -> dict[str, tuple[int, float]]:
    return {r["hop"]: (r["n"], r["p50_us"]) for r in report["hops"]}


def _check_two_way(report: dict) -> None:
    got = _figures(report)
    want = {"frame REQUEST_DATA r0 -> r1": (1, 40.0), "frame SESSION_QUIESCED r1 -> r0": (1, 25.0),
            "carried KV_RESULT r1 -> r0 (post -> received)": (1, 300.0),
            "r1 post -> post_returned": (1, 200.0), "r0 open_receive -> send": (1, 10.0)}
    for hop, figure in want.items():
        assert got.get(hop) == figure, f"{hop}: {got.get(hop)} instead of {figure}"
    assert report["not_comparable"] == [] and report["inconsistent"] == []


def test_frames_carried_reports_and_stages_are_matched_exactly() -> None:
    _check_two_way(hop_report(_two_way()))


def test_mutant_frames_matched_by_seq_alone_is_caught(monkeypatch) -> None:
    monkeypatch.setattr(hops, "_frame_key", lambda src, dst, seq: (seq,))
    with pytest.raises(AssertionError, match="SESSION_QUIESCED"):
        _check_two_way(hop_report(_two_way()))


def _check_no_figure_across_clocks(report: dict) -> None:
    assert report["not_comparable"] == [[0, 1]], f"not_comparable: {report['not_comparable']}"
    cross = [r["hop"] for r in report["hops"] if not r["hop"].startswith(("r0 ", "r1 "))]
    assert not cross, f"cross-rank figures between two clocks: {cross}"
    assert _figures(report)["r1 post -> post_returned"] == (1, 200.0)


def test_ranks_on_different_clocks_get_no_cross_rank_figure() -> None:
    _check_no_figure_across_clocks(hop_report(_two_way(clock_1="monotonic boot other offset 0 0")))
    _check_no_figure_across_clocks(hop_report(_two_way(clock_1=None)))  # an old dump: clock unknown


def test_mutant_that_trusts_any_two_clocks_is_caught(monkeypatch) -> None:
    monkeypatch.setattr(hops, "comparable", lambda a, b: True)
    with pytest.raises(AssertionError, match="not_comparable"):
        _check_no_figure_across_clocks(hop_report(_two_way(clock_1="monotonic boot other offset 0 0")))


def _check_never_negative(report: dict) -> None:
    negative = [r["hop"] for r in report["hops"] if r["min_us"] < 0]
    assert not negative, f"negative figures: {negative}"


def test_a_negative_pair_drops_that_rank_pairs_figures() -> None:
    dumps = _two_way()
    dumps[1].events[0]["t_ns"] = 900_000  # "received" before it was sent: the headers lied about the clock
    report = hop_report(dumps)
    _check_never_negative(report)
    assert report["inconsistent"] == [[0, 1]]
    assert "frame SESSION_QUIESCED r1 -> r0" in _figures(report)  # the other direction still holds


def test_mutant_without_the_negative_guard_is_caught(monkeypatch) -> None:
    monkeypatch.setattr(hops, "_consistent", lambda hopset: True)
    dumps = _two_way()
    dumps[1].events[0]["t_ns"] = 900_000
    with pytest.raises(AssertionError, match="negative figures: .*frame REQUEST_DATA r0 -> r1"):
        _check_never_negative(hop_report(dumps))


def test_dumps_of_one_rank_process_merge_and_two_processes_are_refused(tmp_path, capsys) -> None:
    """Rule 4: a bench writes a dump per new slow session, each holding the last ring; read together
    they count each event once. Two processes claiming one rank are two worlds: exit 2, nothing printed."""
    first, second = _two_way()
    early = Dump(1, 101, CLOCK, second.events[:2])  # the same ring, dumped before the session ended
    _check_two_way(hop_report([first, second, early]))
    paths = []
    for i, (rank, pid) in enumerate(((0, 100), (1, 101), (1, 999))):
        path = tmp_path / f"d{i}.jsonl"
        header = {"type": "header", "rank": rank, "pid": pid, "clock": CLOCK}
        path.write_text(json.dumps(header) + "\n")
        paths.append(str(path))
    assert inspect_main(["--hops", *paths[:2]]) == 0
    capsys.readouterr()
    assert inspect_main(["--hops", *paths]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "rank 1 comes from more than one process" in err
    junk = tmp_path / "junk.jsonl"
    junk.write_text(json.dumps({"type": "header", "rank": 0, "pid": 1}) + "\n"
                    + json.dumps({"type": "event", "kind": "send"}) + "\n")
    assert inspect_main(["--hops", str(junk)]) == 2
    assert "without t_ns" in capsys.readouterr().err


def test_clock_identity_names_this_boot() -> None:
    ident = clock_identity()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert ident is not None and boot in ident and ident == clock_identity()


@pytest.mark.timeout(60)
def test_hops_of_a_real_world(tmp_path, capsys) -> None:
    """Two ranks over real NIXL: three sessions land and one is cancelled; the dumps of both ranks read
    together give a figure for every REQUEST_DATA and every carried report, none negative."""
    from kvown import KVLayout, TransferConfig, make_request_id
    from kvown.testing.local import local_world

    layout = KVLayout.standard(num_layers=1, num_blocks=8, tokens_per_block=2, num_kv_heads=2, head_dim=8,
                               dtype="uint8")
    world = local_world({0: {"sender"}, 1: {"receiver"}}, layout=layout,
                        config=TransferConfig(transfer_timeout_s=30.0))
    try:
        tx, rx = world[0], world[1]
        for i in range(4):
            rid = make_request_id(3, i)
            h = rx.receiver.receive(rid, 1, (0,))
            tx.sender.send(rid, (i,))
            if i == 3:
                rx.receiver.cancel(rid)
            else:
                assert h.landed.wait(10)
                rx.receiver.release(rid)
            assert h.retired.wait(10)
        paths = [rt.flight_dump(str(tmp_path / f"r{rank}.jsonl")) for rank, rt in sorted(world.items())]
    finally:
        for rt in world.values():
            rt.close()
    assert inspect_main(["--hops", "--json", *paths]) == 0
    report = json.loads(capsys.readouterr().out)
    figures = {r["hop"]: r for r in report["hops"]}
    assert report["clocks"]["0"] == report["clocks"]["1"] == clock_identity()
    assert report["not_comparable"] == []
    assert figures["frame REQUEST_DATA r1 -> r0"]["n"] == 4
    assert figures["carried KV_RESULT r0 -> r1 (post -> received)"]["n"] >= 3
    _check_never_negative(report)
    assert inspect_main(["--hops", *paths]) == 0
    assert "frame REQUEST_DATA r1 -> r0" in capsys.readouterr().out
