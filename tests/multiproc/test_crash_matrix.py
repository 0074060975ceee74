"""The crash matrix (issue 11): kill one rank at each protocol point, in each mode, in a real mpirun world.

A cell is (mode, point, role, kind): the world of tests/multiproc/worlds/crash_world.py runs its
workload until the named crash point of ``kvown.testing.faults`` fires on the rank that sees it, and
then the victim (the writer, rank 0, or the receiver, the last rank) dies by SIGKILL or by an uncaught
exception in its main thread. Each cell checks:

  1. the point fired (OUT/crash.json), so the cell is not vacuous;
  2. every rank's PID is gone within grace + 1 s of that instant (``KVOWN_RANK_CRASH_GRACE_S`` = 1);
  3. the world ended as a crash (exit 137: killed, or RANK_CRASH), never as a deadline, an invariant
     (a broken retirement canary is one) or an engine crash;
  4. the victim of "raise" left its own fail-stop flight recorder naming the crash (the ranks the
     launcher ends - SIGTERM, SIGKILL about 250 ms later - dump on SIGTERM as best effort: counted
     as a figure, ``terminated_dumps``, not checked);
  5. no block was reused while a writer might still write: in the receiver's flight recorder every
     retirement of a request comes after proof (a KV_RESULT or SESSION_QUIESCED for that request) from
     every writer it was published to, and the receiver's canaries never fired.

Every cell runs in the slow run (``-m slow``); CI runs ``CI_SLICE``. Three planted bugs show that the
checks can fail: a receiver that retires a cancelled session without proof (check 5), a runtime whose
exit hooks are off (check 2), and a fail-stop executor whose dump is off (check 4); a fourth, ranks
without the launcher-SIGTERM dump, shows in the figure.
``KVOWN_CRASH_REPORT=cells.jsonl`` appends each cell's figures.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest
from crashkit import GRACE_S, MODES, retirements_without_proof, run_cell

from kvown.testing.faults import CRASH_POINTS

ROLES = ("sender", "receiver")
KINDS = ("kill", "raise")
CI_SLICE = {
    ("gen-first", "write-posted", "receiver", "kill"),
    ("ctx-first", "write-done", "sender", "raise"),
    ("fan-in", "cancel-sent", "sender", "kill"),
    ("broadcast", "retire", "receiver", "raise"),
}


def problems_of(cell: dict, kind: str) -> list[str]:
    """Checks 1-5 of the module docstring; an empty list is a pass."""
    problems = []
    if cell["crash"] is None:  # checks 2-4 need the crash instant; check 5 still reads what was left
        problems.append(f"the crash point never fired (exit {cell['rc']})")
    elif cell["gone_s"] is None or cell["gone_s"] > GRACE_S + 1.0:
        problems.append(f"ranks not all gone within grace + 1 s: {cell['gone_s']}")
    if cell["rc"] != 137:
        problems.append(f"world exit code {cell['rc']}, want 137 (a crash, not a deadline or an invariant)")
    reasons = {r: [recs[0]["reason"] for recs in dumps] for r, dumps in cell["flights"].items()}
    if any(reason in ("invariant", "deadline", "engine_crash") for rs in reasons.values() for reason in rs):
        problems.append(f"a rank fail-stopped for another reason: {reasons}")
    if kind == "raise" and "rank_crash" not in reasons.get(cell["victim"], []):
        problems.append(f"no flight recorder from the victim naming its crash: {reasons.get(cell['victim'])}")
    for records in cell["flights"].get(cell["receiver"], []):
        problems += retirements_without_proof([r for r in records if r["type"] == "event"])
    return problems


def terminated_dumps(cell: dict) -> tuple[int, int]:
    """(dumps, ranks) for the ranks the launcher ended (SIGTERM, then SIGKILL about 250 ms later): the
    dump is best effort there (kvown.runtime.failstop.install_sigterm_dump), so it is a figure, not a
    check. The victim is not counted: SIGKILLed, or it dumped on its own fail-stop (check 4)."""
    peers = [r for r in range(cell["ranks"]) if r != cell["victim"]]
    return sum(r in cell["flights"] for r in peers), len(peers)


def report(cell_id: str, cell: dict, problems: list[str]) -> None:
    path = os.environ.get("KVOWN_CRASH_REPORT")
    if path:
        crash = cell["crash"] or {}
        receiver_checked = bool(cell["flights"].get(cell["receiver"]))
        dumps, peers = terminated_dumps(cell)
        with open(path, "a") as f:
            f.write(
                json.dumps(
                    {
                        "cell": cell_id,
                        "gone_s": cell["gone_s"],
                        "wall_s": round(cell["wall_s"], 2),
                        "rc": cell["rc"],
                        "request": crash.get("request"),
                        "ok": not problems,
                        "receiver_recorder_checked": receiver_checked,
                        "terminated_dumps": dumps,
                        "terminated_ranks": peers,
                    }
                )
                + "\n"
            )


CELLS = [
    pytest.param(*cell, id="-".join(cell), marks=() if cell in CI_SLICE else (pytest.mark.slow,))
    for cell in itertools.product(MODES, CRASH_POINTS, ROLES, KINDS)
]


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("mode", "point", "role", "kind"), CELLS)
def test_crash_cell(tmp_path, mode, point, role, kind):
    cell = run_cell(tmp_path, mode, point, role, kind)
    problems = problems_of(cell, kind)
    report(f"{mode}-{point}-{role}-{kind}", cell, problems)
    assert not problems, "\n".join(problems) + "\n" + cell["output"][-2500:]
    assert cell["crash"]["point"] == point and cell["crash"]["victim"] == cell["victim"]


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=() if m == "broadcast" else (pytest.mark.slow,)) for m in MODES]
)
def test_without_a_crash_every_request_ends_and_every_point_is_reached(tmp_path, mode):
    """The control cell: no crash; the workload ends cleanly and passes each point at least as often as
    the matrix's ``nth`` needs, on the rank that observes it (so no cell can pass by never firing)."""
    cell = run_cell(tmp_path, mode, "none", "sender", "kill")
    assert cell["rc"] == 0, cell["output"][-3000:]
    ends = {r: json.loads((tmp_path / f"rank{r}.end.json").read_text()) for r in range(cell["ranks"])}
    rx = ends[cell["receiver"]]
    assert rx["outcomes"] == ["completed", "cancelled"] * 4
    nth = {
        "before-publish": 5,
        "request-data": 5,
        "write-posted": 3,
        "write-done": 3,
        "kv-result-sent": 3,
        "cancel-sent": 2,
        "quiesced-sent": 1,  # as crash_world.NTH: some cancels are proven by a carried result instead
        "retire": 4,
    }
    for point, need in nth.items():
        observer = (
            cell["receiver"] if point in ("before-publish", "request-data", "cancel-sent", "retire") else 0
        )
        assert ends[observer]["counts"][point] >= need, (point, ends[observer]["counts"])


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_the_matrix_catches_a_receiver_that_retires_without_proof(tmp_path):
    """Planted bug: cancelled sessions retire at once, before the writer's word. Check 5 must see it."""
    cell = run_cell(tmp_path, "gen-first", "cancel-sent", "sender", "kill", mutant="retire-without-proof")
    problems = problems_of(cell, "kill")
    assert any("retired without proof" in p for p in problems), (problems, cell["output"][-2000:])


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_matrix_catches_a_runtime_without_exit_hooks(tmp_path):
    """Planted bug: the runtime's exit hooks are off, so a rank whose main thread dies leaves its peers
    running until a deadline. Check 2 must see it."""
    cell = run_cell(tmp_path, "gen-first", "write-posted", "sender", "raise", mutant="no-exit-hooks")
    problems = problems_of(cell, "raise")
    assert any("not all gone" in p for p in problems), (problems, cell["gone_s"], cell["output"][-2000:])


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_matrix_catches_a_fail_stop_that_leaves_no_flight_recorder(tmp_path):
    """Planted bug: the fail-stop executor skips its diagnostics. Check 4 must see it."""
    cell = run_cell(tmp_path, "gen-first", "write-done", "sender", "raise", mutant="no-executor-dump")
    problems = problems_of(cell, "raise")
    assert any("no flight recorder from the victim" in p for p in problems), (problems, cell["output"][-2000:])


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_without_the_sigterm_dump_the_terminated_ranks_leave_nothing(tmp_path):
    """Planted bug: no rank installs the launcher-SIGTERM dump: the figure drops to zero of N."""
    cell = run_cell(tmp_path, "fan-in", "write-posted", "sender", "kill", mutant="no-sigterm-dump")
    assert terminated_dumps(cell) == (0, 2), cell["flights"].keys()


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", [pytest.param(m, marks=() if m == "gen-first" else (pytest.mark.slow,)) for m in MODES])
def test_a_frozen_writer_holds_the_blocks_until_the_world_fail_stops_at_the_deadline(tmp_path, mode):
    """Writer 0 freezes itself (SIGSTOP) right after posting a WRITE: alive, silent, its WRITE unproven.
    The receiver must hold the destination, retire nothing without proof, and fail-stop the world at
    its deadline (timeout 1 s + grace 1 s after the publication, so at most 2 s after the freeze): not
    before the grace, and every rank gone soon after (bound: 2 s more, for a loaded 2-core machine; the
    figures are in docs/reliability.md)."""
    cell = run_cell(tmp_path, mode, "write-posted", "sender", "freeze", CRASH_WORLD_TIMEOUT_S="1")
    out = cell["output"][-2500:]
    assert cell["crash"] is not None and cell["rc"] == 75, f"exit {cell['rc']}\n{out}"
    assert cell["gone_s"] is not None and 1.0 <= cell["gone_s"] <= 1.0 + 1.0 + 2.0, cell["gone_s"]
    dumps = cell["flights"].get(cell["receiver"], [])
    deadline = [d for d in dumps if d[0]["reason"] == "deadline"]
    assert deadline and "writer 0" in deadline[0][0]["detail"], [d[0] for d in dumps]
    for records in dumps:
        assert not retirements_without_proof([r for r in records if r["type"] == "event"])
    report(f"{mode}-write-posted-sender-freeze", cell, [])


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_frozen_writer_check_catches_a_receiver_that_frees_on_its_timeout(tmp_path):
    cell = run_cell(tmp_path, "gen-first", "write-posted", "sender", "freeze", "timer-free",
                    CRASH_WORLD_TIMEOUT_S="1")
    dumps = cell["flights"].get(cell["receiver"], [])
    caught = cell["rc"] != 75 or any(
        retirements_without_proof([r for r in records if r["type"] == "event"]) for records in dumps
    )
    assert caught, (cell["rc"], [d[0]["reason"] for d in dumps])
