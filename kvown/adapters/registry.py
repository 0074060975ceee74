"""Discovery for worlds launched apart: a small etcd v3 client (JSON gateway over HTTP, via httpx).

Owns: ``EtcdClient`` (put / get / list by prefix / delete / leases / watch on one etcd endpoint),
``LeasedKey`` (a value under a lease that a named thread keeps alive) and ``PrefixWatcher`` (a live,
validated view of every value under a prefix, with put and delete callbacks, each value parsed by the
caller's ``parse``). kvown's ``PeerInfo`` records travel through them (``kvown.rank.connect_registry``).

Rules:
  1. Untrusted bytes. Everything etcd returns (its JSON, keys, base64 values, revisions) and every
     value another rank wrote is validated before use; a violation raises
     ``PeerProtocolError(field=...)`` naming the part, and changes no state. Sizes are capped before
     decoding.
  2. A rank's key lives under a lease with a TTL, renewed every TTL/3 by the keep-alive thread: a
     killed rank's key is gone within about one TTL; ``Registration.close`` revokes it at once.
  3. A lease expiry proves only that the rank stopped renewing (dead, hung, or partitioned from etcd).
     It is never proof that a writer stopped writing: transports decide that (docs/embedding.md).
  4. Every wait is bounded: each HTTP call has a timeout; the watch stream is read with a read timeout
     and re-opened from a fresh snapshot after any error, so a missed event is never permanent.
  5. Thread-owned clients: each thread (caller, keep-alive, watcher) uses its own ``httpx.Client``.

Invariants:
  INV-REG-1  A ``PrefixWatcher`` view holds only values that parsed (malformed ones are reported to
             ``on_error`` and skipped, never stored).
  INV-REG-2  After ``on_delete(key)`` the key is absent from the view until a later put.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from kvown.core.errors import AdapterError, ConfigError, PeerProtocolError

MAX_RESPONSE_NBYTES = 4 << 20  # a range response over a prefix of a few hundred ranks
MAX_VALUE_NBYTES = 64 << 10  # one rank's info; NIXL agent metadata is well under this
MAX_KEY_LEN = 512
MAX_WATCH_LINE_NBYTES = MAX_RESPONSE_NBYTES


# ---------------------------------------------------------------------------------------- validation


def _get(obj: Any, name: str, kind: type | tuple[type, ...], where: str, default: Any = None) -> Any:
    """``obj[name]`` checked to be ``kind``; missing gives ``default`` (etcd omits zero values)."""
    if not isinstance(obj, dict):
        raise PeerProtocolError("etcd answered something that is not a JSON object", field=where)
    value = obj.get(name, default)
    if value is None and default is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise PeerProtocolError(
            "etcd field has the wrong type", field=f"{where}.{name}", value=type(value).__name__
        )
    return value


def _int64(obj: Any, name: str, where: str) -> int:
    """etcd's gateway writes int64 as a decimal string and omits zeros."""
    raw = _get(obj, name, (str, int), where, default="0")
    if isinstance(raw, int):
        return raw
    if not re.fullmatch(r"-?[0-9]{1,20}", raw):
        raise PeerProtocolError("etcd int64 field is not a decimal", field=f"{where}.{name}", value=raw[:40])
    return int(raw)


def _b64(obj: Any, name: str, where: str, *, limit: int) -> bytes:
    raw = _get(obj, name, str, where, default="")
    if len(raw) > (limit * 4) // 3 + 4:
        raise PeerProtocolError("etcd value too large", field=f"{where}.{name}", nbytes=len(raw))
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as error:
        raise PeerProtocolError("etcd value is not base64", field=f"{where}.{name}") from error


def _key(obj: Any, where: str) -> str:
    raw = _b64(obj, "key", where, limit=MAX_KEY_LEN)
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError as error:
        raise PeerProtocolError("etcd key is not ASCII", field=f"{where}.key") from error


def _enc(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def _prefix_end(prefix: str) -> str:
    """etcd's range end for "every key starting with prefix": the prefix with its last byte + 1."""
    raw = bytearray(prefix.encode("ascii"))
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return _enc(b"\0")
    raw[-1] += 1
    return _enc(bytes(raw))


def _check_key(key: str) -> str:
    if not key or len(key) > MAX_KEY_LEN or not key.isascii():
        raise ConfigError("etcd key must be 1..512 ASCII characters", field="key", value=key[:80])
    return key


# --------------------------------------------------------------------------------------------- client


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    key: str
    value: bytes  # empty for "delete"
    revision: int


class EtcdClient:
    """One etcd endpoint (``http://host:port``). Not shared between threads (rule 5).

    After error: transport failures raise ``AdapterError`` (cause kept); malformed answers raise
    ``PeerProtocolError``; the client stays usable.
    """

    def __init__(self, endpoint: str, *, timeout_s: float = 2.0) -> None:
        if not re.fullmatch(r"https?://[A-Za-z0-9.\-\[\]:]+", endpoint):
            raise ConfigError(
                "etcd endpoint must look like http://host:port",
                field="endpoint",
                value=endpoint,
                fix="pass e.g. --etcd http://127.0.0.1:2379",
            )
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.endpoint, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        try:
            response = self._http.post(path, json=dict(body))
        except httpx.HTTPError as error:
            raise AdapterError(
                "etcd request failed", cause=error, endpoint=self.endpoint, path=path
            ) from error
        if len(response.content) > MAX_RESPONSE_NBYTES:
            raise PeerProtocolError("etcd response too large", field=path, nbytes=len(response.content))
        try:
            data = response.json()
        except ValueError as error:
            raise PeerProtocolError(
                "etcd response is not JSON", field=path, status=response.status_code
            ) from error
        if not isinstance(data, dict):
            raise PeerProtocolError("etcd response is not an object", field=path)
        if response.status_code != 200:
            message = data.get("message") or data.get("error")
            raise AdapterError(
                "etcd refused the request",
                endpoint=self.endpoint,
                path=path,
                status=response.status_code,
                detail=str(message)[:200],
            )
        return data

    def health(self) -> bool:
        """True when etcd answers a range request. Called: at startup, to wait for etcd."""
        try:
            self._call("/v3/kv/range", {"key": _enc("\0health")})
        except (AdapterError, PeerProtocolError):
            return False
        return True

    # -- leases
    def grant_lease(self, ttl_s: int) -> int:
        """Grant a lease; returns its id. Keys put under it vanish ``ttl_s`` after the last renewal."""
        if not (1 <= ttl_s <= 3600):
            raise ConfigError("lease TTL must be 1..3600 s", field="ttl_s", value=ttl_s)
        data = self._call("/v3/lease/grant", {"TTL": ttl_s})
        lease_id = _int64(data, "ID", "lease_grant")
        if lease_id <= 0:
            raise PeerProtocolError("etcd granted no lease", field="lease_grant.ID", value=lease_id)
        return lease_id

    def keep_alive_once(self, lease_id: int) -> int:
        """Renew once; returns the TTL left (0: the lease has already expired or been revoked)."""
        data = self._call("/v3/lease/keepalive", {"ID": lease_id})
        result = _get(data, "result", dict, "keepalive", default={})
        if _int64(result, "ID", "keepalive.result") not in (0, lease_id):
            raise PeerProtocolError("etcd renewed another lease", field="keepalive.result.ID")
        return _int64(result, "TTL", "keepalive.result")

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke: every key under the lease is deleted now. Revoking an unknown lease is not an error."""
        try:
            self._call("/v3/lease/revoke", {"ID": lease_id})
        except AdapterError as error:
            if "not found" not in str(error):
                raise

    # -- keys
    def put(self, key: str, value: bytes, *, lease_id: int = 0) -> int:
        """Write ``key``; returns the new revision."""
        if len(value) > MAX_VALUE_NBYTES:
            raise ConfigError(
                "etcd value too large", field="value", nbytes=len(value), limit=MAX_VALUE_NBYTES
            )
        body: dict[str, Any] = {"key": _enc(_check_key(key)), "value": _enc(value)}
        if lease_id:
            body["lease"] = lease_id
        data = self._call("/v3/kv/put", body)
        return _int64(_get(data, "header", dict, "put", default={}), "revision", "put.header")

    def delete(self, key: str) -> int:
        data = self._call("/v3/kv/deleterange", {"key": _enc(_check_key(key))})
        return _int64(data, "deleted", "deleterange")

    def get(self, key: str) -> bytes | None:
        found, _ = self._range({"key": _enc(_check_key(key))})
        return found.get(key)

    def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """Every key under ``prefix`` and the revision of that snapshot."""
        return self._range({"key": _enc(_check_key(prefix)), "range_end": _prefix_end(prefix)})

    def _range(self, body: dict[str, Any]) -> tuple[dict[str, bytes], int]:
        data = self._call("/v3/kv/range", body)
        revision = _int64(_get(data, "header", dict, "range", default={}), "revision", "range.header")
        kvs = _get(data, "kvs", list, "range", default=[])
        found: dict[str, bytes] = {}
        for i, kv in enumerate(kvs):
            where = f"range.kvs[{i}]"
            found[_key(kv, where)] = _b64(kv, "value", where, limit=MAX_VALUE_NBYTES)
        return found, revision

    def watch_prefix(
        self, prefix: str, *, start_revision: int, read_timeout_s: float, stop: threading.Event
    ) -> Iterator[WatchEvent]:
        """Stream the events under ``prefix`` from ``start_revision`` until ``stop`` is set.

        Called: by one watcher thread. The stream is read with ``read_timeout_s``; a stream quiet for
        that long simply ends, so the caller re-snapshots (rule 4). Ownership: none.
        """
        body = {
            "create_request": {
                "key": _enc(_check_key(prefix)),
                "range_end": _prefix_end(prefix),
                "start_revision": start_revision,
                "progress_notify": True,
            }
        }
        timeout = httpx.Timeout(self.timeout_s, read=read_timeout_s)
        try:
            with self._http.stream("POST", "/v3/watch", json=body, timeout=timeout) as response:
                if response.status_code != 200:
                    raise AdapterError("etcd refused the watch", status=response.status_code)
                for line in _bounded_lines(response.iter_bytes(), MAX_WATCH_LINE_NBYTES):
                    if stop.is_set():
                        return
                    yield from _parse_watch_line(line)
        except httpx.ReadTimeout:
            return  # a quiet stream: the caller re-snapshots, which doubles as a poll (rule 4)
        except httpx.HTTPError as error:
            if stop.is_set():
                return
            raise AdapterError("etcd watch stream broke", cause=error, endpoint=self.endpoint) from error


def _bounded_lines(chunks: Iterator[bytes], limit: int) -> Iterator[bytes]:
    """Split a byte stream on newlines, refusing any line over ``limit`` before buffering it all."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if line.strip():
                yield line
        if len(pending) > limit:
            raise PeerProtocolError("etcd watch line too long", field="watch", nbytes=len(pending))
    if pending.strip():
        yield pending


def _parse_watch_line(line: bytes) -> Iterator[WatchEvent]:
    try:
        data = json.loads(line)
    except ValueError as error:
        raise PeerProtocolError("etcd watch line is not JSON", field="watch") from error
    if isinstance(data, dict) and "error" in data:
        raise AdapterError("etcd watch failed", detail=str(data["error"])[:200])
    result = _get(data, "result", dict, "watch")
    if result is None:
        raise PeerProtocolError("etcd watch line has no result", field="watch.result")
    if _get(result, "canceled", bool, "watch.result", default=False):
        raise AdapterError(
            "etcd cancelled the watch (compacted?)", reason=str(result.get("cancel_reason", ""))[:200]
        )
    for i, event in enumerate(_get(result, "events", list, "watch.result", default=[])):
        where = f"watch.events[{i}]"
        kind = _get(event, "type", str, where, default="PUT")
        if kind not in ("PUT", "DELETE"):
            raise PeerProtocolError("unknown etcd event type", field=f"{where}.type", value=kind[:20])
        kv = _get(event, "kv", dict, where)
        if kv is None:
            raise PeerProtocolError("etcd event has no kv", field=f"{where}.kv")
        key = _key(kv, f"{where}.kv")
        value = _b64(kv, "value", f"{where}.kv", limit=MAX_VALUE_NBYTES) if kind == "PUT" else b""
        yield WatchEvent(
            "put" if kind == "PUT" else "delete", key, value, _int64(kv, "mod_revision", f"{where}.kv")
        )


# ---------------------------------------------------------------------------------- lease + watcher


class LeasedKey:
    """Publish ``value`` under ``key`` with a leased TTL, renewed by a named thread.

    Called: ``start`` once after the owner can serve; ``close`` once at exit (revokes: watchers see it
    gone at once). If the lease expired anyway (etcd unreachable, or this process starved, for a whole
    TTL), the owner is invisible: ``on_lost`` runs on the keep-alive thread and ``lost`` counts it; with
    ``rejoin`` the thread then grants a new lease and publishes the value again (retried every period
    until it succeeds), otherwise it stops renewing. Rejoin suits a server that a router should find
    again; a rank whose peers must treat an expiry as final leaves it off.
    After error: ``start`` raises ``AdapterError`` when etcd is unreachable; nothing is left behind.
    """

    def __init__(
        self,
        endpoint: str,
        key: str,
        value: bytes,
        *,
        ttl_s: int = 5,
        on_lost: Callable[[], None] | None = None,
        rejoin: bool = False,
    ) -> None:
        if len(value) > MAX_VALUE_NBYTES:
            raise ConfigError("value too large for the registry", field="value", nbytes=len(value))
        self.key = _check_key(key)
        self._endpoint, self._value, self._ttl_s, self._on_lost = endpoint, value, ttl_s, on_lost
        self._rejoin = rejoin
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lease_id = 0  # 0 while no lease holds the key (before start, after a loss, after close)
        self.lost = 0

    def start(self) -> LeasedKey:
        with EtcdClient(self._endpoint) as client:
            self._publish(client)
        self._thread = threading.Thread(
            target=self._keep_alive, name=f"etcd-lease-{self.key.rsplit('/', 1)[-1]}", daemon=True
        )
        self._thread.start()
        return self

    def _publish(self, client: EtcdClient) -> None:
        lease_id = client.grant_lease(self._ttl_s)
        client.put(self.key, self._value, lease_id=lease_id)  # a raise leaves the new lease to its TTL
        self.lease_id = lease_id

    def _keep_alive(self) -> None:
        period_s = max(self._ttl_s / 3.0, 0.2)
        with EtcdClient(self._endpoint, timeout_s=period_s) as client:
            while not self._stop.wait(period_s):
                try:
                    if not self.lease_id:
                        self._publish(client)  # rejoining after a loss
                        continue
                    ttl_left = client.keep_alive_once(self.lease_id)
                except (AdapterError, PeerProtocolError):
                    continue  # retry next period; the TTL covers two missed renewals
                if ttl_left <= 0:
                    self.lease_id = 0
                    self.lost += 1
                    if self._on_lost is not None:
                        self._on_lost()
                    if not self._rejoin:
                        return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.lease_id:
            try:
                with EtcdClient(self._endpoint) as client:
                    client.revoke_lease(self.lease_id)
            except (AdapterError, PeerProtocolError):
                pass  # the TTL removes the key anyway
            self.lease_id = 0


class PrefixWatcher:
    """A live view ``{name: parse(name, value)}`` of every value under ``prefix``, kept by a named thread.

    Called: ``start`` once; ``snapshot``/``get`` from any thread (they copy under a lock);
    ``on_put(info)`` / ``on_delete(name)`` / ``on_error(exc)`` run on the watcher thread, must not
    block, and see events in etcd's revision order. A stream error re-snapshots: names missing from
    the new snapshot are reported deleted (INV-REG-2), so nothing is missed for good (rule 4).
    """

    def __init__(
        self,
        endpoint: str,
        prefix: str,
        *,
        on_put: Callable[[Any], None] | None = None,
        on_delete: Callable[[str], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        read_timeout_s: float = 5.0,
        parse: Callable[[str, bytes], Any],
    ) -> None:
        self._endpoint, self._prefix = endpoint, _check_key(prefix)
        self._parse = parse  # (name under the prefix, raw value) -> value; raises PeerProtocolError
        self._on_put, self._on_delete, self._on_error = on_put, on_delete, on_error
        self._read_timeout_s = read_timeout_s
        self._view: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch{prefix}", daemon=True)
        self.errors = 0

    def start(self, *, timeout_s: float = 5.0) -> PrefixWatcher:
        self._thread.start()
        if not self._synced.wait(timeout_s):
            raise AdapterError("etcd watcher got no first snapshot", endpoint=self._endpoint)
        return self

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._view)

    def get(self, name: str) -> Any:
        with self._lock:
            return self._view.get(name)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._read_timeout_s + 2)

    def _report(self, error: BaseException) -> None:
        self.errors += 1
        if self._on_error is not None:
            self._on_error(error)

    def _apply(self, kind: str, key: str, value: bytes) -> None:
        name = key[len(self._prefix) :]
        if kind == "put":
            try:
                info = self._parse(name, value)
            except PeerProtocolError as error:
                self._report(error)
                kind = "delete"  # a malformed value replaces whatever was there: treat as gone
            else:
                with self._lock:
                    self._view[name] = info
                if self._on_put is not None:
                    self._on_put(info)
                return
        with self._lock:
            present = self._view.pop(name, None) is not None
        if present and self._on_delete is not None:
            self._on_delete(name)

    def _run(self) -> None:
        backoff_s = 0.05
        with EtcdClient(self._endpoint) as client:
            while not self._stop.is_set():
                try:
                    found, revision = client.get_prefix(self._prefix)
                    for gone in set(self.snapshot()) - {k[len(self._prefix) :] for k in found}:
                        self._apply("delete", self._prefix + gone, b"")
                    for key, value in found.items():
                        self._apply("put", key, value)
                    self._synced.set()
                    backoff_s = 0.05
                    for event in client.watch_prefix(
                        self._prefix,
                        start_revision=revision + 1,
                        read_timeout_s=self._read_timeout_s,
                        stop=self._stop,
                    ):
                        self._apply(event.kind, event.key, event.value)
                except (AdapterError, PeerProtocolError) as error:
                    if self._stop.is_set():
                        return
                    self._report(error)
                    self._stop.wait(backoff_s)
                    backoff_s = min(backoff_s * 2, 1.0)


def wait_for_etcd(endpoint: str, *, timeout_s: float) -> None:
    """Block until etcd answers, at most ``timeout_s``. After error: ``AdapterError``."""
    deadline = time.monotonic() + timeout_s
    with EtcdClient(endpoint, timeout_s=0.5) as client:
        while time.monotonic() < deadline:
            if client.health():
                return
            time.sleep(0.05)
    raise AdapterError("etcd did not answer in time", endpoint=endpoint, timeout_s=timeout_s)
