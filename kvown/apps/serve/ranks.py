"""The reference server's records in etcd: ``RankInfo`` (what a server or router publishes about itself),
``Registration`` (one record under a lease) and ``parse_rank_info`` (the ``PrefixWatcher`` parser for them).

Serve vocabulary (roles prefill / decode / router) over kvown's generic discovery adapter
(``kvown.adapters.registry``: leases, watchers, validation of everything etcd returns, rule 1 there).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvown.adapters.registry import MAX_VALUE_NBYTES, LeasedKey
from kvown.core.errors import PeerProtocolError

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
HOSTPORT_RE = re.compile(r"[A-Za-z0-9.\-\[\]:]{1,253}:[0-9]{1,5}")


# ------------------------------------------------------------------------------------------ rank info


@dataclass(frozen=True)
class RankInfo:
    """What a rank publishes about itself. ``parse`` is the only way in from etcd (rule 1).

    ``name`` is unique in the cluster; ``role`` one of ``ROLES``; ``http`` and ``link`` are
    ``host:port`` (empty when the rank has no such endpoint); ``meta`` carries small extra facts
    (KV layout fields, NIXL agent name), strings and ints only.
    """

    ROLES = ("prefill", "decode", "router", "rank")

    name: str
    role: str
    pid: int
    started_ns: int
    http: str = ""
    link: str = ""
    meta: Mapping[str, str | int] = field(default_factory=dict)

    def encode(self) -> bytes:
        self.validate(self)
        return json.dumps(
            {
                "v": 1,
                "name": self.name,
                "role": self.role,
                "pid": self.pid,
                "started_ns": self.started_ns,
                "http": self.http,
                "link": self.link,
                "meta": dict(self.meta),
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def parse(cls, raw: bytes) -> RankInfo:
        """Decode and validate bytes read from etcd. After error: ``PeerProtocolError(field=...)``."""
        if len(raw) > MAX_VALUE_NBYTES:
            raise PeerProtocolError("rank info too large", field="info", nbytes=len(raw))
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            raise PeerProtocolError("rank info is not JSON", field="info") from error
        if not isinstance(data, dict):
            raise PeerProtocolError("rank info is not an object", field="info")
        if data.get("v") != 1:
            raise PeerProtocolError("unknown rank info version", field="v", value=str(data.get("v"))[:20])
        meta = data.get("meta", {})
        if not isinstance(meta, dict) or len(meta) > 64:
            raise PeerProtocolError("rank info meta must be a small object", field="meta")
        # Types are checked by ``validate`` right below; until then these are untrusted values.
        info = cls(
            name=data.get("name"),  # type: ignore[arg-type]
            role=data.get("role"),  # type: ignore[arg-type]
            pid=data.get("pid"),  # type: ignore[arg-type]
            started_ns=data.get("started_ns"),  # type: ignore[arg-type]
            http=data.get("http", ""),
            link=data.get("link", ""),
            meta=meta,
        )
        cls.validate(info)
        return info

    @staticmethod
    def validate(info: RankInfo) -> None:
        if not isinstance(info.name, str) or not NAME_RE.fullmatch(info.name):
            raise PeerProtocolError("bad rank name", field="name", value=str(info.name)[:80])
        if info.role not in RankInfo.ROLES:
            raise PeerProtocolError("unknown role", field="role", value=str(info.role)[:20])
        for name in ("pid", "started_ns"):
            value = getattr(info, name)
            if type(value) is not int or not (0 <= value < 1 << 63):
                raise PeerProtocolError("must be a non-negative int64", field=name, value=str(value)[:40])
        for name in ("http", "link"):
            value = getattr(info, name)
            if not isinstance(value, str) or (value and not HOSTPORT_RE.fullmatch(value)):
                raise PeerProtocolError("must be host:port or empty", field=name, value=str(value)[:80])
            if value and not (0 < int(value.rsplit(":", 1)[1]) < 65536):
                raise PeerProtocolError("port out of range", field=name, value=value)
        for key, value in info.meta.items():
            if not isinstance(key, str) or not NAME_RE.fullmatch(key):
                raise PeerProtocolError("bad meta key", field="meta", value=str(key)[:40])
            ok = (type(value) is int and abs(value) < 1 << 63) or (
                isinstance(value, str) and len(value) <= 512
            )
            if not ok:
                raise PeerProtocolError("meta values are short strings or int64", field=f"meta.{key}")


class Registration(LeasedKey):
    """One rank's ``RankInfo`` under ``prefix + name``, leased (see ``LeasedKey``)."""

    def __init__(self, endpoint: str, prefix: str, info: RankInfo, *, ttl_s: int = 5,
                 on_lost: Callable[[], None] | None = None, rejoin: bool = False) -> None:
        super().__init__(endpoint, prefix + info.name, info.encode(), ttl_s=ttl_s, on_lost=on_lost, rejoin=rejoin)


def parse_rank_info(name: str, raw: bytes) -> RankInfo:
    """The default ``PrefixWatcher`` parser: a ``RankInfo`` whose name is its key's last part."""
    info = RankInfo.parse(raw)
    if info.name != name:
        raise PeerProtocolError("rank info name differs from its key", field="name", key=name, value=info.name)
    return info


__all__ = ["RankInfo", "Registration", "parse_rank_info"]
