"""The short P/D smoke of ``make test``: a real vLLM prefill + decode pair with NixlConnector (pull,
fp32, kvown's baseline fix) behind kvown's proxy answers token for token like the single instance,
for a prompt shorter than a block and one of several blocks, whole and streamed. The edge cases,
NixlPushConnector and disconnects are in test_vllm_pd.py (make test-vllm)."""

from __future__ import annotations

import httpx
import pytest
from vllmkit import complete, running, token_prompt

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def nixl_stack(tiny_model, tmp_path_factory):
    with running("nixl", tiny_model, tmp_path_factory.mktemp("vllm-nixl-smoke")) as stack:
        yield stack


@pytest.mark.parametrize(("n_tokens", "stream"), [(11, False), (700, True), (700, False)])
def test_pd_equals_single(nixl_stack, single_stack, n_tokens, stream):
    prompt = token_prompt(n_tokens, seed=n_tokens)
    ids, _, usage = complete(nixl_stack.url, prompt, 24, stream=stream)
    want, _, _ = complete(single_stack.url, prompt, 24)
    assert usage["prompt_tokens"] == n_tokens
    assert ids == want and len(ids) == 24


def test_the_transfer_happened(nixl_stack):
    """The decode instance loaded KV from the prefill instance (not a local recompute that would pass
    the token check too): vLLM's NIXL transfer counter moved."""
    decode = nixl_stack.instances["decode-0"].instance.url
    text = httpx.get(f"{decode}/metrics", timeout=10).text
    transfers = [line for line in text.splitlines()
                 if line.startswith("vllm:nixl_num_kv_transfers") or "nixl_xfer_time_seconds_count" in line]
    assert transfers and any(float(line.split()[-1]) > 0 for line in transfers), text[-2000:]
