"""etcd registry against a real etcd on loopback: leases, keep-alive, prefix views, watch, hostile values.

Each test module starts its own etcd (skipped with a reason when the binary is missing) and stops it.
Every wait is bounded.
"""

from __future__ import annotations

import base64
import json
import threading
import time

import pytest

from kvown.adapters import registry as reg
from kvown.adapters.registry import EtcdClient, PrefixWatcher
from kvown.apps.serve.ranks import RankInfo, Registration, parse_rank_info
from kvown.apps.serve.etcd import INSTALL_HINT, EtcdProcess, find_etcd
from kvown.core.errors import AdapterError, ConfigError, PeerProtocolError


@pytest.fixture(scope="module")
def etcd():
    if find_etcd() is None:
        pytest.skip(f"no etcd binary: {INSTALL_HINT}")
    with EtcdProcess() as proc:
        yield proc.endpoint


def _info(name: str, role: str = "prefill", **kw) -> RankInfo:
    return RankInfo(
        name=name,
        role=role,
        pid=123,
        started_ns=456,
        http="127.0.0.1:8000",
        link="127.0.0.1:9000",
        meta={"num_layers": 2, "dtype": "float32"},
        **kw,
    )


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_put_get_prefix_delete(etcd):
    with EtcdClient(etcd) as c:
        c.put("/t1/a", b"1")
        c.put("/t1/b", b"\x00\xff")
        c.put("/t10/c", b"not under /t1/")
        assert c.get("/t1/a") == b"1"
        assert c.get("/t1/missing") is None
        found, revision = c.get_prefix("/t1/")
        assert found == {"/t1/a": b"1", "/t1/b": b"\x00\xff"} and revision > 0
        assert c.delete("/t1/a") == 1
        assert c.get("/t1/a") is None


def test_lease_expiry_deletes_key_and_keepalive_keeps_it(etcd):
    with EtcdClient(etcd) as c:
        dying = c.grant_lease(1)
        c.put("/t2/dying", b"x", lease_id=dying)
        kept = Registration(etcd, "/t2/", _info("kept"), ttl_s=1).start()
        try:
            assert _wait(lambda: c.get("/t2/dying") is None, 12), "an unrenewed lease outlived 12 s"
            time.sleep(3.0)  # past the effective TTL (etcd raises 1 s to 2 s): only keep-alive explains it
            assert RankInfo.parse(c.get("/t2/kept")) == _info("kept")
        finally:
            kept.close()
        assert c.get("/t2/kept") is None  # close revokes: gone at once, not after the TTL
        assert c.keep_alive_once(dying) == 0


def test_watcher_sees_put_and_dead_rank_without_deadline(etcd):
    events: list[tuple[str, str]] = []
    watcher = PrefixWatcher(
        etcd,
        "/t3/",
        on_put=lambda i: events.append(("put", i.name)),
        on_delete=lambda n: events.append(("delete", n)),
        parse=parse_rank_info,
    ).start()
    try:
        with EtcdClient(etcd) as c:
            lease = c.grant_lease(1)  # a rank that registered and then died (never renews)
            c.put("/t3/p0", _info("p0").encode(), lease_id=lease)
            assert _wait(lambda: watcher.get("p0") is not None, 5)
            t0 = time.monotonic()
            # etcd raises a 1 s TTL to its minimum (2 s here) and checks expiry in batches, which lag
            # on a loaded machine: allow 12 s, still well under any request deadline (30 s)
            assert _wait(lambda: ("delete", "p0") in events, 12)
            assert time.monotonic() - t0 < 12
            assert watcher.get("p0") is None
    finally:
        watcher.stop()
    assert events[0] == ("put", "p0")


def test_watcher_initial_snapshot_and_resync_reports_missed_deletes(etcd):
    with EtcdClient(etcd) as c:
        c.put("/t4/a", _info("a").encode())
        watcher = PrefixWatcher(etcd, "/t4/", read_timeout_s=0.5, parse=parse_rank_info).start()
        try:
            assert set(watcher.snapshot()) == {"a"}
            c.put("/t4/b", _info("b", role="decode").encode())
            assert _wait(lambda: watcher.get("b") is not None, 5)
            assert watcher.get("b").role == "decode"
            c.delete("/t4/a")
            assert _wait(lambda: watcher.get("a") is None, 5)
        finally:
            watcher.stop()


HOSTILE_VALUES = [
    (b"\xff\xfe", "info"),
    (b"[]", "info"),
    (json.dumps({"v": 2}).encode(), "v"),
    (json.dumps({"v": 1, "name": "../x", "role": "prefill", "pid": 1, "started_ns": 1}).encode(), "name"),
    (json.dumps({"v": 1, "name": "a", "role": "boss", "pid": 1, "started_ns": 1}).encode(), "role"),
    (json.dumps({"v": 1, "name": "a", "role": "decode", "pid": -1, "started_ns": 1}).encode(), "pid"),
    (json.dumps({"v": 1, "name": "a", "role": "decode", "pid": True, "started_ns": 1}).encode(), "pid"),
    (
        json.dumps(
            {"v": 1, "name": "a", "role": "decode", "pid": 1, "started_ns": 1, "link": "evil.example; rm -rf"}
        ).encode(),
        "link",
    ),
    (
        json.dumps(
            {"v": 1, "name": "a", "role": "decode", "pid": 1, "started_ns": 1, "http": "127.0.0.1:70000"}
        ).encode(),
        "http",
    ),
    (
        json.dumps(
            {"v": 1, "name": "a", "role": "decode", "pid": 1, "started_ns": 1, "meta": {"k": [1]}}
        ).encode(),
        "meta.k",
    ),
    (b"{" * 70000, "info"),
]


@pytest.mark.parametrize(("raw", "field"), HOSTILE_VALUES)
def test_rank_info_rejects_malformed_values_naming_the_field(raw, field):
    with pytest.raises(PeerProtocolError) as caught:
        RankInfo.parse(raw)
    assert caught.value.field == field


def test_watcher_skips_malformed_value_and_drops_previous_one(etcd):
    errors: list[BaseException] = []
    with EtcdClient(etcd) as c:
        c.put("/t5/a", _info("a").encode())
        watcher = PrefixWatcher(etcd, "/t5/", on_error=errors.append, parse=parse_rank_info).start()
        try:
            assert watcher.get("a") is not None
            c.put("/t5/a", b"garbage")  # a forged overwrite: the old, good value must not survive it
            assert _wait(lambda: watcher.get("a") is None, 5)
            c.put("/t5/b", _info("other").encode())  # name differs from the key
            assert _wait(lambda: len(errors) >= 2, 5)
            assert watcher.get("b") is None and watcher.get("other") is None
        finally:
            watcher.stop()
    assert {e.field for e in errors} == {"info", "name"}


@pytest.mark.parametrize(
    ("line", "field"),
    [
        (b"not json", "watch"),
        (b'{"result": {"events": [{"type": "BOOM", "kv": {"key": "YQ=="}}]}}', "watch.events[0].type"),
        (b'{"result": {"events": [{"kv": {"key": "!!"}}]}}', "watch.events[0].kv.key"),
        (
            b'{"result": {"events": [{"kv": {"key": "YQ==", "mod_revision": "1e9"}}]}}',
            "watch.events[0].kv.mod_revision",
        ),
        (b'{"result": {"events": [{"kv": {"key": "YQ==", "value": 5}}]}}', "watch.events[0].kv.value"),
        (b'{"result": {"events": "no"}}', "watch.result.events"),
    ],
)
def test_hostile_watch_lines_name_the_field(line, field):
    with pytest.raises(PeerProtocolError) as caught:
        list(reg._parse_watch_line(line))
    assert caught.value.field == field


def test_well_formed_watch_line_parses():
    key, value = base64.b64encode(b"/k").decode(), base64.b64encode(b"v").decode()
    line = json.dumps(
        {
            "result": {
                "events": [
                    {"kv": {"key": key, "value": value, "mod_revision": "7"}},
                    {"type": "DELETE", "kv": {"key": key, "mod_revision": "8"}},
                ]
            }
        }
    )
    assert list(reg._parse_watch_line(line.encode())) == [
        reg.WatchEvent("put", "/k", b"v", 7),
        reg.WatchEvent("delete", "/k", b"", 8),
    ]


def test_unreachable_etcd_is_adapter_error_and_bad_endpoint_is_config_error():
    with pytest.raises(ConfigError):
        EtcdClient("127.0.0.1:2379")
    with EtcdClient("http://127.0.0.1:1", timeout_s=0.5) as c, pytest.raises(AdapterError):
        c.put("/x", b"y")


def test_registration_on_lost_fires_when_the_lease_is_revoked_behind_its_back(etcd):
    lost = threading.Event()
    r = Registration(etcd, "/t6/", _info("r"), ttl_s=1, on_lost=lost.set).start()
    try:
        with EtcdClient(etcd) as c:
            c.revoke_lease(r.lease_id)
        assert lost.wait(5)
    finally:
        r.close()


@pytest.mark.parametrize("rejoin", [True, False], ids=["rejoin", "mutant-no-rejoin"])
def test_a_rejoining_registration_comes_back_after_its_lease_is_lost(etcd, rejoin):
    """A server starved past its TTL must be found again; without ``rejoin`` (the mutant) it stays gone."""
    lost = threading.Event()
    r = Registration(etcd, "/t7/", _info("r"), ttl_s=1, on_lost=lost.set, rejoin=rejoin).start()
    try:
        first = r.lease_id
        with EtcdClient(etcd) as c:
            c.revoke_lease(first)
            assert c.get("/t7/r") is None  # the key went with the lease: invisible
            assert lost.wait(5) and r.lost == 1
            deadline = time.monotonic() + 3
            while c.get("/t7/r") is None and time.monotonic() < deadline:
                time.sleep(0.05)
            back = c.get("/t7/r")
        if rejoin:
            assert back is not None and r.lease_id not in (0, first)
        else:
            assert back is None and r.lease_id == 0
    finally:
        r.close()
    with EtcdClient(etcd) as c:
        assert c.get("/t7/r") is None  # close revoked the new lease


def test_etcd_process_stops_and_cleans_up():
    if find_etcd() is None:
        pytest.skip(f"no etcd binary: {INSTALL_HINT}")
    proc = EtcdProcess().start()
    pid, endpoint = proc.pid, proc.endpoint
    data_dir = proc._data_dir
    proc.stop()
    proc.stop()  # idempotent
    import os

    assert not os.path.exists(data_dir)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with EtcdClient(endpoint, timeout_s=0.5) as c:
        assert not c.health()
