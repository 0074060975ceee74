"""Records (kvown.core.record): every event, action, envelope, frame, delivery and write outcome keeps
rule 1 (its fields are its ``__init__`` parameters, each stored under its own name), compares and hashes
by type and fields, and - compiled - refuses any assignment after construction (rule 2)."""

from __future__ import annotations

import pytest

from kvown.adapters import transport
from kvown.core import actions, events, messages, routing
from kvown.core.record import Record, record_fields
from kvown.runtime.build import is_compiled


def _records() -> list[type]:
    found = []
    for module in (actions, events, messages, routing, transport):
        found += [c for c in vars(module).values()
                  if isinstance(c, type) and issubclass(c, Record) and c.__module__ == module.__name__]
    return found


RECORDS = _records()


def _sample(cls: type, salt: int) -> Record:
    return cls(*(f"{name}-{salt}" for name in record_fields(cls)))  # types are not checked interpreted


def test_the_hot_path_records_are_all_found() -> None:
    names = {c.__name__ for c in RECORDS}
    assert {"Envelope", "Frame", "Delivery", "Posted", "PostWrite", "MessageReceived", "Tick"} <= names


@pytest.mark.interpreted_only  # a compiled record checks its fields' types: the sample strings would not pass
@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_each_parameter_is_stored_under_its_own_name(cls: type) -> None:
    r = _sample(cls, 1)
    assert [getattr(r, f) for f in record_fields(cls)] == [f"{f}-1" for f in record_fields(cls)]
    assert r == _sample(cls, 1) and hash(r) == hash(_sample(cls, 1))
    assert (r != _sample(cls, 2)) is bool(record_fields(cls))
    assert repr(r).startswith(f"{cls.__name__}(")


def test_equality_is_by_type_and_fields() -> None:
    a, b = events.ReleaseRequested(7), actions.RetireBlocks(7)
    assert a == events.ReleaseRequested(7) and a != events.ReleaseRequested(8) and a != b
    assert len({a, events.ReleaseRequested(7), b}) == 2
    assert repr(a) == "ReleaseRequested(request_id=7)"


def test_replace_copies_with_changes_and_names_an_unknown_field() -> None:
    post = transport.NotPosted("busy")
    assert post.replace(reason="gone") == transport.NotPosted("gone") and post.reason == "busy"
    with pytest.raises(TypeError, match="'nope'"):
        post.replace(nope=1)


@pytest.mark.skipif(not is_compiled("kvown.core.events"), reason="the interpreted build has no run-time guard")
def test_a_compiled_record_refuses_assignment() -> None:
    e = events.WriteCompleted(3)
    with pytest.raises(AttributeError):
        e.op_id = 4  # type: ignore[misc]
    assert e.op_id == 3
