"""Lost and late notifications in real mpirun worlds (issue 11; the exhaustive version by position is
tests/sim/test_lost_frames.py).

The crash world's workload (tests/multiproc/worlds/crash_world.py, no crash point) with one
notification lost, held back past the deadline, or failing to send, over real NIXL. Transfer timeout
and grace are 1 s each. Two honest endings, and never a hang or a retirement without proof from every
writer:

  fail-stop   a lost or late *ordered* control frame (a REQUEST_DATA, a CANCEL_SESSION, a
              SESSION_QUIESCED) leaves a hole in its stream: the world fail-stops at the deadline
              (exit 75, the receiver's flight recorder names the request and its unproven writer);
  recovered   a lost or late *carried* result (a KV_RESULT riding on its WRITE as the NIXL
              notification, outside the ordered streams): the session times out, the receiver's
              cancel reaches a writer that is already quiescent, and its SESSION_QUIESCED is the proof
              that lets the blocks go (exit 0; a late copy of the result is stale, counted, not
              disputed).

A send that raised is resent: the world ends normally. The deadline check turns red on a planted
bug: a receiver that frees on its timeout instead (``test_planted_timer_free_is_caught``).
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


def lost_frame_cell(tmp_path, plan: str, mutant: str = "") -> dict:
    """One generation-first crash world with no crash point, ``plan`` injected, timeout and grace T_S."""
    return run_cell(tmp_path, "gen-first", "none", "sender", "kill", mutant,
                    CRASH_WORLD_PLAN=plan, CRASH_WORLD_TIMEOUT_S=str(T_S))


def check_recovered_with_proof(cell: dict, *, timed_out: bool = True) -> None:
    out = cell["output"][-2500:]
    assert cell["rc"] == 0, f"exit {cell['rc']}, want 0 (recovered)\n{out}"
    dumps = [r for r in cell["flights"].get(cell["receiver"], []) if r[0]["reason"] == "end"]
    assert dumps, f"no end-of-world recorder from the receiver\n{out}"
    events = [r for r in dumps[0] if r["type"] == "event"]
    problems = retirements_without_proof(events)
    assert not problems, problems
    concluded = [e for e in events if e["kind"] == "conclude"]
    assert not timed_out or any(e["detail"]["outcome"] == "timed_out" for e in concluded), concluded
    end = json.loads((cell["out"] / "rank1.end.json").read_text())
    assert end["pool"]["free"] == end["pool"]["total"], end["pool"]


# id -> (fault plan, ending). Writer rank 0's notifications: the carried KV_RESULT of each completed
# request, SESSION_QUIESCED of the cancelled ones; receiver rank 1's: REQUEST_DATA, CANCEL_SESSION.
# Request 0 completes, request 1 is cancelled right after publication, and so on.
CASES = {
    "writer-drops-its-first-kv-result": ("drop-frame:rank=0:nth=1", "recovered"),
    # the third is a carried result or a SESSION_QUIESCED, as timing decides which proof a cancel gets
    "writer-drops-its-third-frame": ("drop-frame:rank=0:nth=3", "either"),
    "receiver-drops-a-request-data": ("drop-frame:rank=1:nth=4", "fail-stop"),
    "receiver-drops-a-cancel": ("drop-frame:rank=1:nth=3", "fail-stop"),
    "writer-first-kv-result-5s-late": ("late-frame:rank=0:nth=1:ms=5000", "recovered"),
    "receiver-gets-every-frame-3s-late": ("slow-control:rank=1:ms=3000", "fail-stop"),
}
CI_CASES = ("writer-drops-its-first-kv-result", "receiver-drops-a-cancel")


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c in CI_CASES else (pytest.mark.slow,)) for c in CASES]
)
def test_a_lost_or_late_frame_ends_in_a_fail_stop_or_is_recovered_with_proof(tmp_path, case):
    plan, ending = CASES[case]
    cell = lost_frame_cell(tmp_path, plan)
    if ending == "fail-stop" or (ending == "either" and cell["rc"] != 0):
        check_deadline_fail_stop(cell)
    else:
        check_recovered_with_proof(cell, timed_out=ending == "recovered")


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_a_send_that_raises_is_resent_and_the_world_ends_normally(tmp_path):
    # The receiver sends a control frame for every request (REQUEST_DATA, and a CANCEL_SESSION for the odd
    # ones): its first raises before it leaves, a later one after it left. Not the writer: whether it sends
    # any is timing (when its send opens only after a publication and its cancel arrived, the proof rides
    # on the WRITE, as a quiet writer that naps longer now often sees them).
    cell = lost_frame_cell(tmp_path, "send-raise:rank=1:nth=1,send-raise-after:rank=1:nth=3")
    assert cell["rc"] == 0, cell["output"][-3000:]
    ends = {r: json.loads((tmp_path / f"rank{r}.end.json").read_text()) for r in range(2)}
    assert ends[1]["outcomes"] == ["completed", "cancelled"] * 4
    assert ends[1]["engine"]["control_send_failures"] == 2 and ends[1]["engine"]["control_resent"] >= 2
    assert ends[0]["engine"]["duplicate_frames"] >= 1  # the copy resent after the first had left
    assert ends[1]["pool"] == {"total": 8, "free": 8, "owned": 0, "held": 0}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_planted_timer_free_is_caught(tmp_path):
    """Planted bug: the receiver's sessions stop waiting for writers once timed out (the timer every peer
    system ships). With a REQUEST_DATA lost, the stream to the writer has a hole, no proof can come,
    and the session times out: the mutant retires it without proof and never fail-stops, so the
    check above must fail."""
    cell = lost_frame_cell(tmp_path, CASES["receiver-drops-a-request-data"][0], "timer-free")
    with pytest.raises(AssertionError):
        check_deadline_fail_stop(cell)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_planted_timer_free_is_caught_where_a_lost_result_is_recovered(tmp_path):
    """The same planted timer, where kvown recovers a lost carried result by the writer's ack: the
    mutant retires at the timeout, before that ack, and the recovery check must fail."""
    cell = lost_frame_cell(tmp_path, CASES["writer-drops-its-first-kv-result"][0], "timer-free")
    with pytest.raises(AssertionError, match="retired without proof"):
        check_recovered_with_proof(cell)
