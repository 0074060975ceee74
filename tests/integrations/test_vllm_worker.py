"""The connector's worker half (``kvown.integrations.vllm.worker``) over real NIXL, two kvown ranks in one
process lending vLLM-shaped KV tensors: what it reports to vLLM, and when, under aborts and stalls.

Each safety property has its mutant beside it: a decode worker that reports a cancelled receive before
retirement, and a prefill worker that reports a send before kvown released it.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvown import BlockSpace, TransferConfig, make_request_id
from kvown.integrations.vllm import worker as worker_mod
from kvown.integrations.vllm.plan import Cancel, Receive, Send, StepPlan
from kvown.integrations.vllm.worker import Reports, WorkerSettings, WorkerSide, kv_space
from kvown.testing.local import KillRecorder, local_world

NUM_BLOCKS, LAYERS = 16, 2
SHAPE = (NUM_BLOCKS, 2, 4, 16)  # vLLM CPU: [blocks, kv_heads, block_size, 2 * head_dim]
P, D = 0, 1


def kv_caches(seed: float) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn": torch.full(SHAPE, seed + i, dtype=torch.float32) for i in range(LAYERS)}


class Pair:
    def __init__(self, *, timeout_s: float = 5.0, publish_timeout_s: float = 30.0) -> None:
        self.kill = KillRecorder()
        self.caches = {P: kv_caches(0.0), D: kv_caches(100.0)}
        spaces = {r: kv_space(c, NUM_BLOCKS) for r, c in self.caches.items()}
        config = TransferConfig(transfer_timeout_s=timeout_s, grace_s=timeout_s, canary=False)
        self.world = local_world({P: {"sender"}, D: {"receiver"}}, config=config, kill=self.kill, fault="",
                                 memory={r: (spaces[r], lambda rid, blocks: None) for r in (P, D)})
        settings = dict(etcd="unused", cluster="test", publish_timeout_s=publish_timeout_s)
        self.p = WorkerSide(WorkerSettings(rank=P, **settings), roles={"sender"})
        self.d = WorkerSide(WorkerSettings(rank=D, **settings), roles={"receiver"})
        self.p.attach(self.world[P])
        self.d.attach(self.world[D])
        self.reports = {P: Reports(), D: Reports()}

    def step(self, plan_p: StepPlan | None = None, plan_d: StepPlan | None = None, finished=frozenset()):
        """One vLLM step on each side: start_load_kv, the forward, wait_for_save, get_transfer_results."""
        plan_p, plan_d = plan_p or StepPlan(), plan_d or StepPlan()
        self.d.act(plan_d)
        self.p.act(plan_p)
        self.p.save(plan_p)
        for side, out in ((P, self.p.report(set(finished))), (D, self.d.report(set()))):
            for name in ("sending", "recving", "failed"):
                got, seen = getattr(out, name), getattr(self.reports[side], name)
                assert not got & seen, f"{name} reported twice: {got & seen}"
                seen |= got

    def run(self, until, *, finished=frozenset(), timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.step(finished=finished)
            if until():
                return True
            time.sleep(0.002)
        return False

    def close(self) -> None:
        for rt in self.world.values():
            rt.close()


@pytest.fixture
def pair():
    made: list[Pair] = []

    def make(**kw) -> Pair:
        made.append(Pair(**kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def block(caches, b: int) -> list[torch.Tensor]:
    return [t[b] for _, t in sorted(caches.items())]


@pytest.mark.timeout(60)
def test_a_partial_hit_receives_the_prompts_tail_and_both_sides_report_once(pair) -> None:
    x = pair()
    for i, b in enumerate((0, 1, 2, 3)):  # the prefill's prompt blocks, each with its own values
        for t in x.caches[P].values():
            t[b].fill_(10.0 + i)
    rid = make_request_id(3, 1)
    x.step(plan_d=StepPlan(receives=[Receive("d", rid, P, (9, 10))]))  # decode holds token blocks 0-1
    x.step(plan_p=StepPlan(sends=[Send("p", rid, (0, 1, 2, 3))]))
    assert x.run(lambda: "d" in x.reports[D].recving)
    assert x.reports[D].failed == set()
    for got, want in ((9, 2), (10, 3)):  # the tail: token blocks 2 and 3, never the prefix
        assert all(torch.equal(g, w) for g, w in zip(block(x.caches[D], got), block(x.caches[P], want)))
    assert x.run(lambda: x.p.rt.sender.status(rid).phase.value == "released")
    x.step()
    assert x.reports[P].sending == set()  # released, but vLLM has not finished the request yet
    assert x.run(lambda: "p" in x.reports[P].sending, finished={"p"})


def _abort_of_a_stalled_transfer(x: Pair) -> Reports:
    """The decode request is aborted while the writer's WRITE never completes: no report, ever, until
    kvown fail-stops at the deadline (the blocks stay lent)."""
    rid = make_request_id(3, 2)
    x.world[P].inject_fault("stuck-writer:nth=1")
    x.step(plan_d=StepPlan(receives=[Receive("d", rid, P, (4, 5))]))
    x.step(plan_p=StepPlan(sends=[Send("p", rid, (4, 5))]))
    x.run(lambda: x.world[P].statistics().writes_in_flight > 0, timeout_s=5)
    x.step(plan_d=StepPlan(cancels=[Cancel("d", rid)]))  # the client is gone
    x.run(lambda: bool(x.kill.calls), timeout_s=8)
    return x.reports[D]


@pytest.mark.timeout(60)
def test_an_abort_of_a_stalled_transfer_holds_the_blocks_until_the_fail_stop(pair) -> None:
    x = pair(timeout_s=0.5)
    reports = _abort_of_a_stalled_transfer(x)
    assert "d" not in reports.recving  # vLLM never heard it may reuse the blocks
    assert x.kill.calls and x.kill.calls[0][1] == 75  # the deadline fail-stop (ExitCode.DEADLINE)
    assert x.world[D].statistics().pool.held == 2


@pytest.mark.timeout(60)
def test_the_hold_check_catches_a_worker_that_reports_a_cancel_at_once(pair, monkeypatch) -> None:
    original = WorkerSide._settled

    def eager(self, r, out):  # mutant: a cancelled receive is reported as soon as it was cancelled
        if r.handle and r.handle.closing:
            out.recving.add(r.req_id)
            return True
        return original(self, r, out)

    monkeypatch.setattr(WorkerSide, "_settled", eager)
    assert "d" in _abort_of_a_stalled_transfer(pair(timeout_s=0.5)).recving


def _finish_before_release(x: Pair) -> bool:
    """vLLM finishes the prefill request while its WRITE is still in flight: True if the send was
    reported only after kvown released it."""
    rid = make_request_id(3, 3)
    x.world[P].inject_fault("slow-writer:nth=1:ms=400")
    x.step(plan_d=StepPlan(receives=[Receive("d", rid, P, (6, 7))]))
    x.step(plan_p=StepPlan(sends=[Send("p", rid, (6, 7))]), finished={"p"})
    early = "p" in x.reports[P].sending
    handle_released = lambda: x.p.rt.sender.status(rid).phase.value == "released"  # noqa: E731
    x.run(lambda: "p" in x.reports[P].sending and "d" in x.reports[D].recving, finished={"p"})
    return not early and handle_released() and "d" in x.reports[D].recving


@pytest.mark.timeout(60)
def test_a_send_is_reported_only_after_kvown_released_it(pair) -> None:
    assert _finish_before_release(pair())


@pytest.mark.timeout(60)
def test_the_release_check_catches_a_worker_that_reports_a_send_when_vllm_finished(pair, monkeypatch) -> None:
    original = WorkerSide.report

    def eager(self, finished):  # mutant: trust vLLM's "finished" alone
        out = original(self, finished)
        out.sending |= finished & self._sends.keys()
        for req_id in finished & self._sends.keys():
            del self._sends[req_id]
        return out

    monkeypatch.setattr(WorkerSide, "report", eager)
    assert not _finish_before_release(pair())


@pytest.mark.timeout(60)
def test_an_abort_before_publication_is_reported_failed_and_frees_the_writer_at_once(pair) -> None:
    x = pair()
    rid = make_request_id(3, 4)
    x.step(plan_p=StepPlan(sends=[Send("p", rid, (8, 9))]))  # context-first: P's KV is ready
    x.step(plan_d=StepPlan(cancels=[Cancel("d", rid, (P,), report=True)]))
    assert "d" in x.reports[D].recving and "d" in x.reports[D].failed
    t0 = time.monotonic()
    assert x.run(lambda: "p" in x.reports[P].sending, finished={"p"}, timeout_s=5)
    assert time.monotonic() - t0 < 2.0  # told at once, not after any timeout


@pytest.mark.timeout(60)
def test_a_prefill_abort_fails_the_published_decode_fast(pair) -> None:
    x = pair()
    rid = make_request_id(3, 5)
    x.step(plan_d=StepPlan(receives=[Receive("d", rid, P, (1, 2))]))
    x.run(lambda: x.d.rt.receiver.status(rid).phase.value == "published", timeout_s=5)
    x.step(plan_p=StepPlan(send_cancels=[Cancel("p", rid)]))  # the prefill request was aborted
    assert x.run(lambda: "d" in x.reports[D].recving, timeout_s=5)
    assert "d" in x.reports[D].failed and x.world[D].statistics().pool.held == 0


@pytest.mark.timeout(60)
def test_a_send_nobody_publishes_to_is_given_up_after_the_publish_timeout(pair) -> None:
    x = pair(publish_timeout_s=0.2)
    rid = make_request_id(3, 6)
    x.step(plan_p=StepPlan(sends=[Send("p", rid, (11,))]))
    assert x.run(lambda: "p" in x.reports[P].sending, finished={"p"}, timeout_s=5)
    assert x.p.rt.sender.status(rid).outcome.value == "cancelled"


@pytest.mark.timeout(30)
def test_settings_name_the_bad_field() -> None:
    from kvown import ConfigError

    good = {"etcd": "http://127.0.0.1:2379", "cluster": "c", "rank": 2}
    assert WorkerSettings.from_extra(good, tp_rank=1).rank == 3
    tuned = WorkerSettings.from_extra({**good, "idle_sleep_max_s": 0.05, "other": 1})
    assert tuned.cadence == (("idle_sleep_max_s", 0.05),)
    for bad, field in (({"cluster": "c", "rank": 0}, "kv_connector_extra_config"), ({**good, "rank": -1}, "rank"),
                       ({**good, "grace_s": 0}, "grace_s"), ({**good, "metrics_port": "x"}, "metrics_port"),
                       ({**good, "idle_sleep_max_s": 5}, "idle_sleep_max_s"), ({**good, "spin_s": "x"}, "spin_s")):
        with pytest.raises(ConfigError) as err:
            WorkerSettings.from_extra(bad)
        assert err.value.field == field


def test_kv_space_covers_every_layout_vllm_uses() -> None:
    cpu = {"a": torch.zeros(SHAPE), "b": torch.zeros(SHAPE)}
    assert len(kv_space(cpu, NUM_BLOCKS).regions) == 2
    flash = {"a": torch.zeros((2, NUM_BLOCKS, 4, 2, 8))}  # [2, blocks, block_size, heads, head_dim]
    assert len(kv_space(flash, NUM_BLOCKS).regions) == 2
    kernel = {"a": torch.zeros((NUM_BLOCKS * 2, 2, 2, 16))}  # kernel blocks half the manager block
    space = kv_space(kernel, NUM_BLOCKS)
    assert space.num_blocks == NUM_BLOCKS and space.block_nbytes == 2 * 2 * 2 * 16 * 4
    assert isinstance(space, BlockSpace) and worker_mod.kv_space is kv_space


def _mismatched_prompt(x: Pair) -> Reports:
    """Prefill and decode disagree on the prompt (a proxy pairing the wrong legs): the KV lands, but the
    digests differ."""
    rid = make_request_id(3, 7)
    x.step(plan_d=StepPlan(receives=[Receive("d", rid, P, (12, 13), b"d" * 16)]))
    x.step(plan_p=StepPlan(sends=[Send("p", rid, (12, 13), b"p" * 16)]))
    x.run(lambda: "d" in x.reports[D].recving)
    return x.reports[D]


@pytest.mark.timeout(60)
def test_kv_of_another_prompt_is_reported_failed_never_decoded(pair) -> None:
    x = pair()
    reports = _mismatched_prompt(x)
    assert "d" in reports.recving and "d" in reports.failed and x.d.prompt_mismatches == 1


@pytest.mark.timeout(60)
def test_the_digest_check_catches_a_worker_that_skips_it(pair, monkeypatch) -> None:
    x = pair()
    monkeypatch.setattr(x.d.rt.receiver, "read_aux", lambda handle: b"d" * 16)  # mutant: trust the landing
    assert "d" not in _mismatched_prompt(x).failed


@pytest.mark.timeout(60)
def test_matching_digests_decode(pair) -> None:
    x = pair()
    rid = make_request_id(3, 8)
    x.step(plan_d=StepPlan(receives=[Receive("d", rid, P, (14,), b"same-prompt-0001")]))
    x.step(plan_p=StepPlan(sends=[Send("p", rid, (14,), b"same-prompt-0001")]))
    assert x.run(lambda: "d" in x.reports[D].recving) and x.reports[D].failed == set()
