"""kvown's error types.

Owns: the whole exception hierarchy. Every raise site in kvown uses one of these. Plus
``require_positive_ints`` / ``require_positive_seconds``, the checks of a config's counts and timeouts.

Rules:
  1. Errors carry fields (request id, rank, state, field name) and read well in a log; never a bare
     status string.
  2. Blame decides the class: ``LocalProtocolError`` is our own bug (an illegal transition asked for
     by local code); ``PeerProtocolError`` is an impossible, malformed or forged peer message.
  3. A raise from a state machine leaves that machine's state unchanged (the handlers validate
     before they mutate).
  4. ``InvariantViolation`` is caught only by the engine, which fail-stops.

    KvownError
    +-- ProtocolError (abstract)
    |   +-- LocalProtocolError
    |   +-- PeerProtocolError
    +-- ConfigError
    +-- AdapterError          (.cause keeps the library's exception)
    +-- InvariantViolation
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class KvownError(Exception):
    """Base of every kvown error. Keyword fields are kept on ``.fields`` and shown in ``str()``."""

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields
        for name, value in fields.items():
            setattr(self, name, value)

    def __str__(self) -> str:
        if not self.fields:
            return self.message
        details = ", ".join(f"{k}={v!r}" for k, v in self.fields.items())
        return f"{self.message} ({details})"


class ProtocolError(KvownError):
    """Abstract: use ``LocalProtocolError`` or ``PeerProtocolError``."""

    def __init__(self, message: str, **fields: Any) -> None:
        if type(self) is ProtocolError:
            raise TypeError("ProtocolError is abstract; raise LocalProtocolError or PeerProtocolError")
        super().__init__(message, **fields)


class LocalProtocolError(ProtocolError):
    """Local code asked for a transition the protocol forbids: a kvown or embedding bug."""


class PeerProtocolError(ProtocolError):
    """A peer sent something impossible, malformed, forged or out of order. ``field`` names the part."""


class ConfigError(KvownError):
    """Bad configuration, raised before anything starts. ``fix`` says what to do, where known."""


class AdapterError(KvownError):
    """A library call failed. ``cause`` is the library's own exception."""

    def __init__(self, message: str, *, cause: BaseException | None = None, **fields: Any) -> None:
        super().__init__(message, **fields)
        self.cause = cause
        if cause is not None:
            self.__cause__ = cause


class InvariantViolation(KvownError):
    """A safety invariant (``INV-*``) failed. Only the engine catches this, and it fail-stops."""


def require_positive_ints(config: object, names: Iterable[str], *, zero_ok: Iterable[str] = ()) -> None:
    """Raise ``ConfigError`` naming the first of ``names`` whose value on ``config`` is not an ``int`` > 0
    (>= 0 for the names in ``zero_ok``; ``bool`` is no integer here)."""
    zero_ok = frozenset(zero_ok)
    for name in names:
        value = getattr(config, name)
        if type(value) is not int or value < 0 or (value == 0 and name not in zero_ok):
            raise ConfigError(f"{name} must be a positive integer, got {value!r}", field=name, value=value)


def require_positive_seconds(config: object, names: Iterable[str]) -> None:
    """Raise ``ConfigError`` naming the first of ``names`` whose value on ``config`` is not > 0 (seconds)."""
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ConfigError(f"{name} must be > 0", field=name, value=value)
