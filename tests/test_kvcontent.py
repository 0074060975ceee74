"""The demo's KV content checks have teeth: a flipped value byte, scale byte or scale-pool byte of one
landed block is counted as one corrupted block, for both NVFP4 scale layouts and for bfloat16."""

from __future__ import annotations

import argparse

import pytest

from kvown.apps.demo_rank import layout_for
from kvown.apps.kvcontent import KVContent
from kvown.cache import KVPool


def content(dtype: str, scale_layout: str = "inline") -> tuple[KVContent, KVPool]:
    args = argparse.Namespace(dtype=dtype, scale_layout=scale_layout, pool_blocks=12)
    pool = KVPool(layout_for(args))
    return KVContent(pool, max_blocks=4), pool


def flip(view, index: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    view[index] ^= 0x10  # in place, through the strided view, into the pool


@pytest.mark.parametrize("scale_layout", ["inline", "separate"])
@pytest.mark.parametrize("where", ["values", "scales"])
def test_nvfp4_checks_catch_one_bad_byte(scale_layout: str, where: str) -> None:
    c, pool = content("nvfp4", scale_layout)
    blocks = (7, 2, 9)  # landed anywhere in the pool, in request order
    c.write(pool, 1234, blocks)
    assert c.bad_blocks(1234, blocks) == 0
    assert c.bad_blocks(1235, blocks) == 3  # another request's KV: every block differs
    if where == "values":
        flip(pool.plane_view("v_values"), (2, 1, 3, 15, 63))
    else:
        flip((pool.scales or pool).plane_view("k_scales"), (2, 0, 1, 4, 5))
    assert c.bad_blocks(1234, blocks) == 1


def test_bfloat16_pattern_check_catches_one_bad_byte() -> None:
    c, pool = content("bfloat16")
    c.write(pool, 77, (3, 4))
    assert c.bad_blocks(77, (3, 4)) == 0
    flip(pool.block_view(4), (4096,))
    assert c.bad_blocks(77, (3, 4)) == 1
