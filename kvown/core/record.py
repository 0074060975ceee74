"""Records: the immutable values the hot path builds per session (events, actions, messages, frames).

Owns: ``Record``, their base: equality, hashing and ``repr`` over the fields.

Rules:
  1. A record's fields are its ``__init__`` parameters, in order; ``__init__`` stores each once, as a
     ``Final`` attribute of the same name, and does nothing else.
  2. Immutable: the type check (mypy, and mypyc's before it compiles) refuses any later assignment, and
     a compiled record has no setter at all (``AttributeError``). The interpreted build runs the same
     checked source without a run-time guard: one would cost a Python call per field.
  3. Equal when of the same type with equal fields (another type: ``NotImplemented``); the hash is over
     the same fields; ``repr`` is ``Name(field=value, ...)``. None of these is on the hot path.
  4. Why not frozen dataclasses: mypyc leaves the ``__init__`` that ``dataclasses`` writes in Python,
     and a frozen one stores each field through ``object.__setattr__`` (300-800 ns a record in the
     compiled build, ~50 ns for a compiled ``__init__``; docs/benchmarks.md, issue 19 fifth pass).
"""

from __future__ import annotations

import inspect
from typing import Any

_FIELDS: dict[type, tuple[str, ...]] = {}  # type -> its fields, read from the signature once (rule 1)


def record_fields(cls: type) -> tuple[str, ...]:
    """The fields of record class ``cls``: its ``__init__`` parameters, in order."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(inspect.signature(cls).parameters)
    return names


class Record:
    __slots__ = ()

    def __init__(self) -> None:
        """No fields (``Tick``). Declared so that every record, compiled too, has a signature to read."""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in record_fields(type(self)))

    def __hash__(self) -> int:
        return hash((type(self), *(getattr(self, f) for f in record_fields(type(self)))))

    def __repr__(self) -> str:
        values = ", ".join(f"{f}={getattr(self, f)!r}" for f in record_fields(type(self)))
        return f"{type(self).__name__}({values})"

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` applied (tests forge inputs with it; never on the hot path)."""
        unknown = set(changes) - set(record_fields(type(self)))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {sorted(unknown)[0]!r}")
        return type(self)(**{f: changes.get(f, getattr(self, f)) for f in record_fields(type(self))})


__all__ = ["Record", "record_fields"]
