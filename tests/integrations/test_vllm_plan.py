"""The connector's scheduler half (``kvown.integrations.vllm.plan``) against stand-ins for vLLM's
request objects: which blocks are received and sent, and that every parked request is reported once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvown import make_request_id
from kvown.integrations.vllm.plan import Cancel, Planner, Receive, Send, prompt_digest, transfer_ids

BS = 4  # tokens per block
RID = make_request_id(7, 1)


def request(req_id="r1", prompt=10, computed=0, **params):
    return SimpleNamespace(request_id=req_id, num_prompt_tokens=prompt, num_computed_tokens=computed,
                           prompt_token_ids=list(range(prompt)),
                           kv_transfer_params={"kvown_request_id": RID, "kvown_writer": 0, **params})


DIGEST = prompt_digest(range(10))


def decode() -> Planner:
    return Planner(block_size=BS, consumer=True, producer=False)


def prefill() -> Planner:
    return Planner(block_size=BS, consumer=False, producer=True)


@pytest.mark.parametrize("params", [None, {}, {"kvown_request_id": -1}, {"kvown_request_id": "7"},
                                    {"kvown_request_id": RID, "kvown_writer": -3},
                                    {"kvown_request_id": RID, "kvown_writer": True}])
def test_requests_without_valid_ids_are_plain_vllm_requests(params) -> None:
    assert transfer_ids(params) is None
    p = decode()
    r = SimpleNamespace(request_id="x", num_prompt_tokens=10, num_computed_tokens=0, prompt_token_ids=[1],
                        kv_transfer_params=None if params is None else {"do_remote_prefill": True, **params})
    assert p.matched_tokens(r, 0) == (0, False)
    p.after_alloc(r, [1, 2, 3], 0, 10)
    assert p.finished(r) == (False, None) and p.build({}, lambda _: []).empty()


def test_decode_loads_every_prompt_block_it_lacks() -> None:
    p = decode()
    r = request(do_remote_prefill=True)
    assert p.matched_tokens(r, 0) == (10, True)
    assert p.matched_tokens(r, 4) == (6, True)  # side-effect free: asked again with a local hit
    p.after_alloc(r, [20, 21, 22, 23], 0, 10)  # a lookahead block more than the 3 the prompt needs
    plan = p.build({}, lambda _: [])
    assert plan.receives == [Receive("r1", RID, 0, (20, 21, 22), DIGEST)]
    assert p.build({}, lambda _: []).empty()  # shipped once


def test_a_partial_local_hit_receives_only_the_missing_tail() -> None:
    p = decode()
    r = request(do_remote_prefill=True)
    p.after_alloc(r, [31, 32], 1, 6)  # block 0 is a local prefix-cache hit
    assert p.build({}, lambda _: []).receives == [Receive("r1", RID, 0, (31, 32), DIGEST)]


def test_a_full_local_hit_tells_the_writer_and_parks_nothing() -> None:
    p = decode()
    r = request(do_remote_prefill=True)
    p.after_alloc(r, [], 3, 0)
    assert p.build({}, lambda _: []).cancels == [Cancel("r1", RID, (0,), report=False)]
    p.after_alloc(r, [40], 3, 0)  # vLLM's second call after the load: changes nothing
    assert p.build({}, lambda _: []).empty()


def test_an_abort_of_a_parked_receive_is_reported_once_whenever_it_comes() -> None:
    p = decode()
    r = request(do_remote_prefill=True)
    p.after_alloc(r, [1, 2, 3], 0, 10)
    assert p.finished(r) == (False, None)  # before the plan shipped: the worker reports it, tells P
    assert p.build({}, lambda _: []).cancels == [Cancel("r1", RID, (0,), report=True)]
    r2 = request("r2", do_remote_prefill=True)
    p.after_alloc(r2, [4, 5, 6], 0, 10)
    p.build({}, lambda _: [])
    p.finished(r2)  # shipped: the worker cancels; the retirement is the report
    assert p.build({}, lambda _: []).cancels == [Cancel("r2", RID)]


def test_a_request_that_ends_before_vllm_admitted_it_still_tells_its_writer() -> None:
    p = decode()
    assert p.finished(request(do_remote_prefill=True)) == (False, None)
    assert p.build({}, lambda _: []).cancels == [Cancel("r1", RID, (0,))]


def test_a_receive_reported_finished_is_forgotten() -> None:
    p = decode()
    r = request(do_remote_prefill=True)
    p.after_alloc(r, [1, 2, 3], 0, 10)
    p.build({}, lambda _: [])
    p.reported(None, {"r1"})
    assert p.pending()["receives_live"] == 0
    p.finished(r)  # it decoded and finished normally: nothing to cancel
    assert p.build({}, lambda _: []).empty()


def test_prefill_sends_in_the_step_that_completes_the_prompt_and_holds_the_blocks() -> None:
    p = prefill()
    r = request(prompt=10, do_remote_decode=True)
    p.after_alloc(r, [], 0, 0)
    blocks = lambda req_id: [5, 6, 7, 8]  # noqa: E731 - one block more than the prompt covers
    assert p.build({"r1": 8}, blocks).sends == []  # a first chunk of 8 tokens: not done yet
    r.num_computed_tokens = 8
    assert p.build({"r1": 2}, blocks).sends == [Send("r1", RID, (5, 6, 7), DIGEST)]
    assert p.finished(r) == (True, {"kvown_request_id": RID})  # delay free until released
    p.reported({"r1"}, None)
    assert p.pending()["sends_live"] == 0


def test_a_prefill_that_ends_before_its_send_opened_only_fences_it() -> None:
    p = prefill()
    r = request(do_remote_decode=True)
    p.after_alloc(r, [], 0, 0)
    assert p.finished(r) == (False, None)  # aborted during prefill: nothing to hold
    assert p.build({}, lambda _: []).send_cancels == [Cancel("r1", RID)]


def test_the_prompt_digest_tells_prompts_apart() -> None:
    assert prompt_digest([1, 2, 3]) == prompt_digest((1, 2, 3)) != prompt_digest([1, 2, 4])
    assert len(prompt_digest([])) == 16 and prompt_digest([2**40]) != prompt_digest([0])
