"""Events rule 4: event and message classes are final, because the cores dispatch on the exact type.
A subclass is refused as an unknown input (a typed error, state unchanged), never handled as its base."""

from __future__ import annotations

import pytest

from kvown.core.errors import LocalProtocolError
from kvown.core.events import Event, OpenSend
from kvown.core.machine import CoreConfig
from kvown.core.messages import Message
from kvown.core.sender import SenderCore


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_all_subclasses(sub)]
    return out


@pytest.mark.parametrize("base", [Event, Message])
def test_no_event_or_message_class_is_subclassed(base: type) -> None:
    kvown_classes = [c for c in _all_subclasses(base) if c.__module__.startswith("kvown.")]
    assert kvown_classes, base
    assert [c.__name__ for c in kvown_classes if c.__subclasses__()] == []


@pytest.mark.interpreted_only  # a Python class cannot subclass a compiled (native) one: there it cannot even exist
def test_a_subclassed_event_is_an_unknown_input() -> None:
    class LateOpenSend(OpenSend):
        pass

    core = SenderCore(CoreConfig(0, 10**9, 10**9, (1,)))
    with pytest.raises(LocalProtocolError) as err:
        core.handle(LateOpenSend(1 << 20, (0,)), 1)
    assert err.value.field == "event" and core.sessions == {}
