"""B0+pub, the W1 baseline that prices kvown's publication alone (issue 19): two real NIXL endpoints in one
process, one thread per rank, over a threaded stand-in for the two ranks' MPI communicator. The writer
posts WRITE i only after it has read publication i, rank 0 keeps at most ``window`` publications ahead,
and plain B0 sends none."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvown.apps.benchmarks.raw import RX, Raw, publication

KIB = 1024


class _Req:
    def __init__(self, test: Any) -> None:
        self.Test = test  # noqa: N815 - mpi4py's name


class ThreadComm:
    """What ``Raw`` asks of an mpi4py communicator, for two ranks that are two threads of one process."""

    def __init__(self, shared: dict[str, Any], rank: int) -> None:
        self.shared, self.rank = shared, rank

    def allgather(self, obj: Any) -> list[Any]:
        self.shared["gather"][self.rank] = obj
        self.shared["barrier"].wait(20)
        out = list(self.shared["gather"])
        self.shared["barrier"].wait(20)
        return out

    def Ibarrier(self) -> _Req:  # noqa: N802 - mpi4py's name
        with self.shared["lock"]:
            n = self.shared["arrived"] = self.shared["arrived"] + 1
        generation = (n + 1) // 2
        return _Req(lambda: self.shared["arrived"] >= 2 * generation)


class _Watched:
    """The rank's real endpoint, with ``send_notif`` seen first by the test."""

    def __init__(self, ep: Any, send_notif: Any) -> None:
        self._ep, self.send_notif = ep, send_notif

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ep, name)


def run_pair(n: int, window: int, published: bool) -> dict[str, Any]:
    shared = {"gather": [None, None], "barrier": threading.Barrier(2), "lock": threading.Lock(), "arrived": 0}
    seen: dict[str, Any] = {"taken": set(), "early_posts": [], "sent_q": [], "ahead_max": 0, "errors": []}

    def rank_main(rank: int) -> None:
        try:
            raw = Raw(ThreadComm(shared, rank), rank, window * 64 * KIB, f"pub{published}", huge_pages=False)
            watch(raw, rank)
            raw.throughput(64 * KIB, n, window, time.monotonic() + 30, published=published)
            raw.close()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            seen["errors"].append(exc)

    def watch(raw: Raw, rank: int) -> None:
        take, post, send = raw.take, raw.post, raw.ep.send_notif

        def taking(prefix: bytes, deadline: float) -> Any:
            got = take(prefix, deadline)
            if rank == 1:
                seen["taken"].add(got[1])
            elif prefix == b"w":
                seen["landed"] = seen.get("landed", 0) + 1
            return got

        def posting(dst: int, src_off: int, dst_off: int, nbytes: int, notif: bytes | None) -> Any:
            i = int(notif[1:]) if notif else -1
            if published and publication(i) not in seen["taken"]:
                seen["early_posts"].append(i)
            return post(dst, src_off, dst_off, nbytes, notif)

        def sending(peer: Any, payload: bytes) -> None:
            if payload.startswith(b"q"):
                seen["sent_q"].append(payload)
                ahead = len(seen["sent_q"]) - seen.get("landed", 0)
                seen["ahead_max"] = max(seen["ahead_max"], ahead)
            send(peer, payload)

        raw.take, raw.post = taking, posting  # type: ignore[method-assign]
        raw.ep = _Watched(raw.ep, sending)  # the compiled build's endpoint takes no instance attributes

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in (RX, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank did not finish within 60 s"
    assert not seen["errors"], seen["errors"]
    return seen


@pytest.mark.timeout(120)
def test_the_writer_writes_a_session_only_after_its_publication() -> None:
    seen = run_pair(n=24, window=4, published=True)
    assert seen["early_posts"] == []
    assert seen["sent_q"] == [publication(i) for i in range(24)]  # each session published once, in order
    assert seen["ahead_max"] <= 4  # the receiver publishes at most a window ahead of what landed


@pytest.mark.timeout(120)
def test_plain_b0_publishes_nothing() -> None:
    seen = run_pair(n=12, window=4, published=False)
    assert seen["sent_q"] == []
