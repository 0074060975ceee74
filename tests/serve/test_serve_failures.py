"""Killing the prefill server (SIGKILL) while clients stream: every affected client gets an error, none
hangs; requests whose KV had landed finish with the right tokens; and the decode server does what its
link promises (docs/embedding.md section 7):

* loopback link: its reader of the dead writer's connection exited, which proves nothing can write any
  more, so every destination of the dead writer comes back and the decode server keeps serving;
* kvown link: a dead writer's lease proves nothing about its WRITEs, so a destination it had not
  settled stays held, and the decode server fail-stops (SIGKILL of itself) at that request's deadline -
  or sooner, once a control frame to the dead writer could not be sent within the resend budget
  (CONTROL_LOST) - its flight recorder naming the writer. It never reuses the blocks.

Once the dead server's lease expires the router answers 503 at once.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from servekit import need_etcd

from kvown.apps.serve.local import LocalStack
from kvown.apps.serve.model import ByteTokenizer, ModelConfig, TinyLM, generate_reference


@pytest.mark.parametrize("link", ["loopback", "kvown"])
def test_killing_the_prefill_mid_stream_gives_errors_not_hangs(tmp_path, link):
    need_etcd()
    torch.set_num_threads(1)
    model, tok = TinyLM(ModelConfig()), ByteTokenizer()
    prompts = [f"victim {i} " + "z" * (150 + 40 * i) for i in range(6)]
    expected = {p: tok.decode(generate_reference(model, tok.encode(p), 40)) for p in prompts}
    # a slow fabric keeps transfers in flight when the prefill dies, so some clients are waiting for KV
    # that will never land (loopback: 150 ms per 4-block frame; kvown: every WRITE reports DONE 1 s late)
    pace = "150" if link == "loopback" else "1000"
    args = ["--num-blocks", "512", "--link-pace-ms", pace, "--link", link, "--landing-timeout", "3"]
    with LocalStack(server_args=args, log_dir=tmp_path, lease_ttl_s=2) as stack:
        decode_before = httpx.get(f"{stack.procs['decode'].url}/health", timeout=5).json()
        outcomes: list[str] = []
        lock = threading.Lock()
        stop_at = [time.monotonic() + 120]  # moved to 2 s after the kill

        def client(i: int) -> None:
            rng = random.Random(i)
            with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=20) as c:
                while time.monotonic() < stop_at[0]:
                    prompt = rng.choice(prompts)
                    text = ""
                    try:
                        for event in c.completions.create(
                            model="kvown-tiny", prompt=prompt, max_tokens=40, temperature=0, stream=True
                        ):
                            text += event.choices[0].text if event.choices else ""
                        result = "ok" if text == expected[prompt] else "mismatch"
                    except openai.APITimeoutError:
                        result = "hang"
                    except (openai.APIStatusError, openai.APIError, openai.APIConnectionError):
                        result = "error"
                    with lock:
                        outcomes.append(result)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        # kill once a request has completed and KV is in flight, so some clients wait for KV that will never land
        _wait_for(lambda: "ok" in outcomes and _kv_in_flight(stack, link), "a completion, then KV in flight")
        stack.procs["prefill"].kill()
        stop_at[0] = time.monotonic() + 2.0
        for t in threads:
            t.join(40)
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert "hang" not in outcomes and "mismatch" not in outcomes, outcomes
        assert outcomes.count("ok") > 0 and outcomes.count("error") > 0, outcomes

        if link == "kvown":
            _decode_fail_stops_at_the_deadline_holding_the_blocks(stack, tmp_path)
            return
        # the decode server is alive, restarted nothing, and holds nothing for the dead writer
        decode = stack.procs["decode"].url
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            health = httpx.get(f"{decode}/health", timeout=5).json()
            b, link = health["blocks"], health["link"]
            if b["free"] == b["total"] and link["owned"] == link["held"] == 0 and health["inflight"] == 0:
                break
            time.sleep(0.1)
        assert health["blocks"]["free"] == health["blocks"]["total"], health
        assert health["link"]["held"] == 0 and health["link"]["owned"] == 0, health
        print(
            "decode link after the kill:",
            health["link"],
            "outcomes:",
            {k: outcomes.count(k) for k in set(outcomes)},
        )
        assert health["link"]["recv_failed"] >= 1  # destinations of the dead writer failed, then came back
        assert (health["pid"], health["started_ns"]) == (decode_before["pid"], decode_before["started_ns"])

        # the lease runs out (TTL 2 s): the router stops offering the dead prefill server
        deadline = time.monotonic() + 20  # etcd's expiry can lag its TTL on a loaded machine
        while time.monotonic() < deadline:
            if "prefill-0" not in httpx.get(f"{stack.url}/health", timeout=5).json()["servers"]:
                break
            time.sleep(0.1)
        t0 = time.monotonic()
        r = httpx.post(f"{stack.url}/v1/completions", json={"prompt": "anyone?", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_server"
        assert time.monotonic() - t0 < 2
        assert not set(stack.dead()) - {"prefill"}


def _kv_in_flight(stack, link: str) -> bool:
    health = httpx.get(f"{stack.procs['decode'].url}/health", timeout=5).json()
    return health["link"]["owned"] > 0 if link == "kvown" else health["inflight"] > 0


def _wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    pytest.fail(f"no {what} within {timeout_s} s")


def _decode_fail_stops_at_the_deadline_holding_the_blocks(stack, tmp_path) -> None:
    """kvown's guarantee: no proof from the dead writer, so no reuse; the decode rank fail-stops by the
    deadline (landing timeout 3 s + grace 3 s after exposure): there, or when its stream to the dead
    writer proves broken (a CANCEL_SESSION or REQUEST_DATA that cannot be sent for 1 s)."""
    decode = stack.procs["decode"]
    link = httpx.get(f"{decode.url}/health", timeout=5).json()["link"]
    # the dead writer's destinations are not given back: still OWNED (its landing timeout has not run out
    # yet: the client may have heard of the failure from the router first) or HELD (timed out, no proof)
    assert link["owned"] + link["held"] > 0, link
    deadline = time.monotonic() + 20
    while decode.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not decode.alive(), "the decode server should have fail-stopped at the deadline"
    assert decode.proc.returncode == -9  # its own SIGKILL: no MPI world to abort
    # LocalStack: dumps beside the logs
    flights = list(Path(stack.log_dir).glob("kvown-flight-rank1-*.jsonl"))
    assert flights, "the decode rank left no flight recorder"
    header = json.loads(flights[0].read_text().splitlines()[0])
    assert header["reason"] in ("deadline", "control_lost"), header
    assert "writer 0" in header["detail"] or "rank 0" in header["detail"], header
