"""Lost and late notifications in real mpirun worlds (issue 11; the exhaustive version by position is
tests/sim/test_lost_frames.py).

The crash world's workload (tests/multiproc/worlds/crash_world.py, no crash point) with one control
frame lost, held back past the deadline, or failing to send, over real NIXL notifications. Transfer
timeout and grace are 1 s each. A lost or late frame must end in a fail-stop at the deadline
(exit 75, the receiver's flight recorder names the request and its unproven writer) - never a hang,
and never a retirement without proof from every writer. A send that raised is resent: the world ends
normally. The deadline check turns red on a planted bug: a receiver that frees on its timeout instead
(``test_planted_timer_free_is_caught``).
"""

from __future__ import annotations

import json

import pytest
from crashkit import retirements_without_proof, run_cell

T_S = 1.0  # transfer timeout and grace of these worlds


def deadline_dump(cell: dict) -> dict:
    """The receiver's own fail-stop recorder (reason deadline): header and events."""
    for records in cell["flights"].get(cell["receiver"], []):
        if records[0]["reason"] == "deadline":
            return {"header": records[0], "events": [r for r in records if r["type"] == "event"]}
    return {}


def check_deadline_fail_stop(cell: dict) -> None:
    out = cell["output"][-2500:]
    assert cell["rc"] == 75, f"exit {cell['rc']}, want 75 (deadline)\n{out}"
    dump = deadline_dump(cell)
    assert dump, f"no deadline flight recorder from the receiver: {cell['flights'].keys()}\n{out}"
    header, events = dump["header"], dump["events"]
    assert "unproven" in header["detail"] and "writer" in header["detail"], header
    rid = header["request_id"]
    opened = [e["t_ns"] for e in events if e["kind"] == "open_receive" and e["request_id"] == rid]
    # the engine records its fail_stop; when the retirement watchdog saw the deadline first, the dump's
    # own time (taken within the 0.5 s dump bound) stands in for it
    fatal = [e["t_ns"] for e in events if e["kind"] == "fail_stop"] or [header["mono_ns"]]
    assert opened
    waited_s = (fatal[0] - opened[-1]) / 1e9
    assert T_S * 0.9 <= waited_s <= 2 * T_S + 0.5, (
        f"fail-stop {waited_s:.3f} s after publication"
    )  # not early
    assert not retirements_without_proof(events)
    assert not any(e["kind"] == "retire" and e["request_id"] == rid for e in events)


CASES = {  # id -> fault plan (writer rank 0 sends KV_RESULT, SESSION_QUIESCED; receiver rank 1 REQUEST_DATA,
    # CANCEL_SESSION; request 0 completes, request 1 is cancelled right after publication)
    "writer-drops-its-first-kv-result": "drop-frame:rank=0:nth=1",
    "writer-drops-its-third-frame": "drop-frame:rank=0:nth=3",
    "receiver-drops-a-request-data": "drop-frame:rank=1:nth=4",
    "receiver-drops-a-cancel": "drop-frame:rank=1:nth=3",
    "writer-first-kv-result-5s-late": "late-frame:rank=0:nth=1:ms=5000",
    "receiver-gets-every-frame-3s-late": "slow-control:rank=1:ms=3000",
}
CI_CASE = "writer-drops-its-first-kv-result"


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c == CI_CASE else (pytest.mark.slow,)) for c in CASES]
)
def test_a_lost_or_late_frame_ends_in_a_fail_stop_at_the_deadline(tmp_path, case):
    cell = run_cell(
        tmp_path,
        "gen-first",
        "none",
        "sender",
        "kill",
        CRASH_WORLD_PLAN=CASES[case],
        CRASH_WORLD_TIMEOUT_S=str(T_S),
    )
    check_deadline_fail_stop(cell)


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_a_send_that_raises_is_resent_and_the_world_ends_normally(tmp_path):
    cell = run_cell(
        tmp_path,
        "gen-first",
        "none",
        "sender",
        "kill",
        CRASH_WORLD_PLAN="send-raise:rank=0:nth=3,send-raise-after:rank=1:nth=2",
        CRASH_WORLD_TIMEOUT_S=str(T_S),
    )
    assert cell["rc"] == 0, cell["output"][-3000:]
    ends = {r: json.loads((tmp_path / f"rank{r}.end.json").read_text()) for r in range(2)}
    assert ends[1]["outcomes"] == ["completed", "cancelled"] * 4
    assert ends[0]["engine"]["control_resent"] >= 1 and ends[1]["engine"]["control_resent"] >= 1
    assert ends[1]["pool"] == {"total": 8, "free": 8, "owned": 0, "held": 0}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_planted_timer_free_is_caught(tmp_path):
    """Planted bug: the receiver's sessions stop waiting for writers once timed out (the timer every peer
    system ships). With the writer's KV_RESULT lost, the world then retires without proof and never
    fail-stops: the check above must fail."""
    cell = run_cell(
        tmp_path,
        "gen-first",
        "none",
        "sender",
        "kill",
        "timer-free",
        CRASH_WORLD_PLAN=CASES[CI_CASE],
        CRASH_WORLD_TIMEOUT_S=str(T_S),
    )
    with pytest.raises(AssertionError):
        check_deadline_fail_stop(cell)
