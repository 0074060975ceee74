"""The link protocol (kvown.apps.serve.link): both links implement it, and the loopback link's fence is
kvown's own, which never forgets an id (its old fence forgot the oldest beyond 65,536: a mutant here)."""

from __future__ import annotations

import collections
import inspect

import pytest

from kvown.apps.serve import kvlink
from kvown.apps.serve.kvlink import KVLink
from kvown.apps.serve.kvownlink import KvownLink
from kvown.apps.serve.link import Link
from kvown.apps.serve.model import ModelConfig, PagedKVCache

CONFIG = ModelConfig(num_layers=1, block_size=4, num_kv_heads=2, head_dim=8)
METHODS = [name for name, _ in inspect.getmembers(Link, inspect.isfunction) if not name.startswith("_")]


@pytest.mark.parametrize("impl", [KVLink, KvownLink])
def test_each_link_has_every_method_of_the_protocol_with_its_parameters(impl) -> None:
    assert {"receive", "release", "cancel", "send", "abort_send", "statistics", "close"} <= set(METHODS)
    for name in METHODS:
        theirs = inspect.signature(getattr(impl, name)).parameters
        ours = inspect.signature(getattr(Link, name)).parameters
        assert list(theirs) == list(ours), (impl.__name__, name, list(theirs), list(ours))


class ForgetfulFence:
    """The loopback link's old fence: remembers the newest ``capacity`` ids only."""

    capacity = 4

    def __init__(self) -> None:
        self.ids: collections.OrderedDict[int, None] = collections.OrderedDict()

    def install(self, rid: int, origin) -> None:
        self.ids[rid] = None
        while len(self.ids) > self.capacity:
            self.ids.popitem(last=False)

    def is_fenced(self, rid: int) -> bool:
        return rid in self.ids


def _first_id_still_fenced(later: int) -> bool:
    """Abort ``1 + later`` sends' ids, then send the first id again: born cancelled (fenced) or not."""
    link = KVLink("prefill-0", PagedKVCache(CONFIG, 8), on_returned=lambda rid, blocks, outcome: None)
    try:
        for rid in range(1, later + 2):
            link.abort_send(rid)
        handle = link.send(1, (0, 1))
        return handle.done.done() and handle.done.result(0) == "cancelled"
    finally:
        link.close()


def test_the_loopback_fence_never_forgets_an_aborted_id() -> None:
    assert _first_id_still_fenced(70_000)  # more than the old fence's 65,536


def test_the_fence_check_catches_a_forgetting_fence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvlink, "CancellationFence", ForgetfulFence)
    assert _first_id_still_fenced(2)  # within its memory it still fences
    assert not _first_id_still_fenced(8)  # the forgotten id would be sent again: the check sees it


def test_a_send_with_an_id_kvown_cannot_fence_is_refused() -> None:
    link = KVLink("prefill-0", PagedKVCache(CONFIG, 8), on_returned=lambda rid, blocks, outcome: None)
    try:
        with pytest.raises(kvlink.LocalProtocolError) as caught:
            link.send(1 << 64, (0,))
        assert caught.value.field == "request_id"
    finally:
        link.close()
