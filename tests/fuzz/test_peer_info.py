"""Regressions for what the peer_info fuzz target found in ``PeerInfo.from_wire`` (it validated nothing).

Each file under tests/fuzz/regressions/peer_info/ is an input the target turned into a crash before
the fix (its name says how: an exception type, or a field accepted out of range). Now each must be a
``PeerProtocolError`` naming the field, as a control frame's would be.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest

from kvown.core.errors import PeerProtocolError
from kvown.adapters.transport import PeerInfo, check_peer
from kvown.testing import fuzz_targets as ft

REGRESSIONS = Path(__file__).parent / "regressions" / "peer_info"
# file -> the field the fixed code must name (the first bad field in wire order). These inputs were
# found against the first record format ([..., pool_addr, pool_nbytes, aux_addr, ..., mem_kind]);
# since the record carries a block space in place of pool_addr, the ones whose damage lay at or after
# that position are refused there, at "space".
EXPECTED_FIELD = {
    "accepted_agent_name": "agent_name",
    "accepted_aux_addr": "space",
    "accepted_mem_kind": "space",
    "accepted_pool_addr": "space",
    "accepted_pool_nbytes": "space",
    "accepted_rank": "rank",
    "bytes_of_negative_int_valueerror": "peer_info",
    "check_hello_typeerror": "space",
    "from_wire_memoryerror": "rank",
    "from_wire_typeerror": "agent_name",
    "from_wire_valueerror": "peer_info",
    "unpack_extradata": "peer_info",
    "unpack_formaterror": "peer_info",
    "unpack_unicodedecodeerror": "peer_info",
    "unpack_valueerror": "peer_info",
}


NAMES = ["rank", "agent_name", "agent_metadata", "space", "aux_addr", "aux_slot_nbytes", "geometry_digest",
         "protocol_version", "capabilities", "roles"]


def _wire(**changes):
    base = ft.local_peer_info(ft._layout(), rank=0).to_wire()
    for name, value in changes.items():
        base[NAMES.index(name)] = value
    return base


def _local():
    return ft.local_peer_info(ft._layout())


def test_every_regression_file_is_listed():
    assert sorted(p.name for p in REGRESSIONS.iterdir()) == sorted(EXPECTED_FIELD)


@pytest.mark.parametrize("name", sorted(EXPECTED_FIELD))
def test_fuzzer_finding_is_now_a_peer_protocol_error(name):
    data = (REGRESSIONS / name).read_bytes()
    with pytest.raises(PeerProtocolError) as info:
        check_peer(_local(), PeerInfo.from_blob(data))
    assert info.value.fields["field"] == EXPECTED_FIELD[name]
    assert ft.peer_info_one_input(data) == f"rejected:{EXPECTED_FIELD[name]}"  # the target's oracle agrees


def test_integer_metadata_is_refused_without_allocating_it():
    # The pre-fix code ran bytes(md): a peer sending md=2**40 made this rank allocate 1 TiB.
    t0 = time.monotonic()
    with pytest.raises(PeerProtocolError) as info:
        PeerInfo.from_wire(_wire(agent_metadata=1 << 40))
    assert info.value.fields["field"] == "agent_metadata"
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"capabilities": [["session_quiesced"]]}, "capabilities"),  # unhashable: check_hello's set() raised
        ({"geometry_digest": 7}, "geometry_digest"),  # check_hello sliced it: TypeError
        ({"rank": -1}, "rank"),
        ({"roles": ["hbm"]}, "roles"),
        ({"space": [[[4096, 64, 64, 1, 1]], 8, "HBM", 0]}, "mem"),
        ({"space": [[[4096, 32, 64, 1, 1]], 8, "DRAM", 0]}, "stride_nbytes"),
        ({"space": [[[1 << 62, 1 << 40, 64, 1, 1]], 1 << 30, "DRAM", 0]}, "regions"),  # past 64 bits
        ({"aux_addr": 1 << 64}, "aux_addr"),
        ({"protocol_version": True}, "protocol_version"),
        ({"agent_name": ""}, "agent_name"),
    ],
)
def test_each_field_is_validated(changes, field):
    with pytest.raises(PeerProtocolError) as info:
        PeerInfo.from_wire(_wire(**changes))
    assert info.value.fields["field"] == field


def test_wrong_shape_is_refused():
    for obj in (None, {}, _wire()[:9], [*_wire(), 1]):
        with pytest.raises(PeerProtocolError) as info:
            PeerInfo.from_wire(obj)
        assert info.value.fields["field"] == "peer_info"


def test_valid_record_round_trips_through_the_rendezvous_blob():
    info = PeerInfo.from_wire(_wire())
    assert PeerInfo.from_blob(msgpack.packb(info.to_wire())) == info
    assert PeerInfo.from_wire(info.to_wire()) == info  # the allgather path
    check_peer(_local(), info)
