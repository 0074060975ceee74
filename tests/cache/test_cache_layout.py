"""KVLayout: sizes, memory order, head slices, digests and validation."""

from __future__ import annotations

import pytest

from kvown.cache import KVLayout, Plane
from kvown.core.errors import ConfigError, LocalProtocolError, PeerProtocolError


def small_standard(**overrides: object) -> KVLayout:
    fields: dict[str, object] = dict(num_layers=3, num_blocks=10, tokens_per_block=4, num_kv_heads=8, head_dim=16)
    fields.update(overrides)
    return KVLayout.standard(**fields)  # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_standard_sizes() -> None:
    layout = small_standard(dtype="float16")
    per_head = 3 * 4 * (16 * 2) * 2  # layers * tokens * (head_dim * 2 bytes) * (K and V)
    assert layout.head_nbytes == per_head
    assert layout.block_nbytes == 8 * per_head
    assert layout.pool_nbytes == 10 * 8 * per_head
    assert layout.plane_block_nbytes("k") == layout.plane_block_nbytes("v") == layout.block_nbytes // 2


@pytest.mark.timeout(10)
def test_mla_is_one_latent_plane_with_one_head() -> None:
    layout = KVLayout.mla(num_layers=2, num_blocks=5, tokens_per_block=8, latent_dim=576)
    assert [plane.name for plane in layout.planes] == ["latent"]
    assert layout.num_kv_heads == 1
    assert layout.block_nbytes == 2 * 8 * 576 * 2
    with pytest.raises(ConfigError) as raised:
        layout.head_slice_ranges(0, 0, 2)
    assert raised.value.fields["field"] == "num_slices"


@pytest.mark.timeout(10)
def test_nvfp4_packs_two_values_per_byte_and_one_scale_per_16() -> None:
    layout = KVLayout.nvfp4(num_layers=2, num_blocks=4, tokens_per_block=16, num_kv_heads=4, head_dim=128)
    sizes = {plane.name: plane.nbytes_per_token for plane in layout.planes}
    assert sizes == {"k_values": 64, "k_scales": 8, "v_values": 64, "v_scales": 8}
    assert layout.block_nbytes == 4 * 2 * 16 * (64 + 8) * 2
    bf16 = KVLayout.standard(num_layers=2, num_blocks=4, tokens_per_block=16, num_kv_heads=4, head_dim=128)
    assert bf16.block_nbytes / layout.block_nbytes == pytest.approx(2 * 128 * 2 / (2 * 72))
    with pytest.raises(ConfigError) as raised:
        KVLayout.nvfp4(num_layers=2, num_blocks=4, tokens_per_block=16, num_kv_heads=4, head_dim=24)
    assert raised.value.fields["field"] == "head_dim"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("field", "value"),
    [("num_layers", 0), ("num_blocks", -1), ("tokens_per_block", 1.5), ("num_kv_heads", True), ("head_dim", 0)],
)
def test_bad_fields_raise_config_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as raised:
        small_standard(**{field: value})
    assert raised.value.fields["field"] == field


@pytest.mark.timeout(10)
def test_bad_dtypes_and_planes_are_rejected() -> None:
    with pytest.raises(ConfigError) as raised:
        small_standard(dtype="float64")
    assert raised.value.fields["field"] == "dtype"
    with pytest.raises(ConfigError):
        KVLayout(1, 1, 1, 1, 1, "uint8", ())
    with pytest.raises(ConfigError):
        KVLayout(1, 1, 1, 1, 1, "uint8", (Plane("k", "uint8", 1), Plane("k", "uint8", 1)))
    with pytest.raises(ConfigError):
        KVLayout(1, 1, 1, 1, 1, "uint8", (Plane("k", "complex", 1),))
    with pytest.raises(ConfigError):
        small_standard().plane_block_nbytes("latent")


@pytest.mark.timeout(10)
def test_head_slices_are_disjoint_single_ranges_that_cover_the_block() -> None:
    layout = small_standard()
    for num_slices in (1, 2, 4, 8):
        for block in (0, 7):
            covered: list[tuple[int, int]] = []
            for index in range(num_slices):
                ranges = layout.head_slice_ranges(block, index, num_slices)
                assert len(ranges) == 1
                covered.extend(ranges)
            covered.sort()
            assert covered[0][0] == block * layout.block_nbytes
            for (offset, nbytes), (next_offset, _) in zip(covered, covered[1:]):
                assert offset + nbytes == next_offset
            assert sum(nbytes for _, nbytes in covered) == layout.block_nbytes
            # A writer holding one slice of the heads has blocks exactly that size.
            assert layout.slice_layout(num_slices).block_nbytes == covered[0][1]


@pytest.mark.timeout(10)
def test_head_slice_argument_errors() -> None:
    layout = small_standard()
    with pytest.raises(ConfigError) as raised:
        layout.head_slice_ranges(0, 0, 3)
    assert raised.value.fields["field"] == "num_slices"
    with pytest.raises(LocalProtocolError) as local:
        layout.head_slice_ranges(0, 2, 2)
    assert local.value.fields["field"] == "slice_index"
    with pytest.raises(LocalProtocolError) as local:
        layout.head_slice_ranges(10, 0, 2)
    assert local.value.fields["field"] == "block"


@pytest.mark.timeout(10)
def test_block_ranges_merge_consecutive_ids_only() -> None:
    layout = small_standard()
    size = layout.block_nbytes
    assert layout.block_ranges([4, 5, 6, 9]) == [(4 * size, 3 * size), (9 * size, size)]
    assert layout.block_ranges([6, 5]) == [(6 * size, size), (5 * size, size)]
    assert layout.block_ranges([]) == []


@pytest.mark.timeout(10)
def test_peer_block_ids_are_checked_with_the_field_named() -> None:
    layout = small_standard()
    layout.check_block_ids([0, 9])
    for bad in ([10], [-1], [True], ["3"]):
        with pytest.raises(PeerProtocolError) as raised:
            layout.check_block_ids(bad, field="dst_blocks")
        assert raised.value.fields["field"] == "dst_blocks"


@pytest.mark.timeout(10)
def test_geometry_digest_ignores_capacity_but_not_geometry() -> None:
    base = small_standard()
    assert base.geometry_digest() == small_standard(num_blocks=999).geometry_digest()
    assert len(base.geometry_digest()) == 64
    for change in (dict(num_layers=4), dict(tokens_per_block=8), dict(num_kv_heads=4), dict(head_dim=32),
                   dict(dtype="float16")):
        assert small_standard(**change).geometry_digest() != base.geometry_digest(), change
    nvfp4 = KVLayout.nvfp4(num_layers=3, num_blocks=10, tokens_per_block=4, num_kv_heads=8, head_dim=16)
    assert nvfp4.geometry_digest() != base.geometry_digest()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("scale_layout", ["inline", "separate"])
def test_nvfp4_scale_layouts_hold_the_same_bytes_in_different_places(scale_layout: str) -> None:
    layout = KVLayout.nvfp4(num_layers=2, num_blocks=4, tokens_per_block=16, num_kv_heads=4, head_dim=128,
                            scale_layout=scale_layout)
    assert layout.scale_layout == scale_layout
    values_nbytes = 4 * 2 * 16 * 64 * 2  # heads * layers * tokens * (128 / 2) * (K and V)
    scales_nbytes = 4 * 2 * 16 * 8 * 2  # one E4M3 per 16 values
    if scale_layout == "inline":
        assert [p.name for p in layout.planes] == ["k_values", "k_scales", "v_values", "v_scales"]
        assert layout.block_nbytes == values_nbytes + scales_nbytes
        with pytest.raises(ConfigError) as raised:
            layout.scale_pool()
        assert raised.value.fields["field"] == "scale_layout"
    else:
        assert [p.name for p in layout.planes] == ["k_values", "v_values"]
        scales = layout.scale_pool()
        assert [p.name for p in scales.planes] == ["k_scales", "v_scales"]
        assert layout.block_nbytes == values_nbytes and scales.block_nbytes == scales_nbytes
        assert scales.num_blocks == layout.num_blocks and scales.num_kv_heads == layout.num_kv_heads
        # A writer holding half the heads has half of both pools.
        half = layout.slice_layout(2)
        assert half.scale_pool().block_nbytes == scales.block_nbytes // 2
    assert layout.transfer_block_nbytes == values_nbytes + scales_nbytes


@pytest.mark.timeout(10)
def test_nvfp4_scale_layout_is_part_of_the_digest() -> None:
    shape = dict(num_layers=3, num_blocks=10, tokens_per_block=4, num_kv_heads=8, head_dim=16)
    inline = KVLayout.nvfp4(**shape)
    separate = KVLayout.nvfp4(**shape, scale_layout="separate")
    digests = {inline.geometry_digest(), separate.geometry_digest(), separate.scale_pool().geometry_digest(),
               small_standard().geometry_digest()}
    assert len(digests) == 4
    assert inline.geometry_digest() == KVLayout.nvfp4(**{**shape, "num_blocks": 99}).geometry_digest()
    with pytest.raises(ConfigError) as raised:
        KVLayout.nvfp4(**shape, scale_layout="interleaved")
    assert raised.value.fields["field"] == "scale_layout"
    with pytest.raises(ConfigError) as raised:
        KVLayout(1, 1, 1, 1, 16, "uint8", (Plane("k_values", "uint8", 8),), "separate")
    assert raised.value.fields["field"] == "scale_planes"


@pytest.mark.timeout(10)
def test_nvfp4_mla_latent_is_one_head_of_values_and_scales() -> None:
    layout = KVLayout.nvfp4_mla(num_layers=2, num_blocks=3, tokens_per_block=8)
    assert [(p.name, p.nbytes_per_token) for p in layout.planes] == [("latent_values", 288), ("latent_scales", 36)]
    assert layout.num_kv_heads == 1 and layout.head_dim == 576
    separate = KVLayout.nvfp4_mla(num_layers=2, num_blocks=3, tokens_per_block=8, scale_layout="separate")
    assert separate.block_nbytes + separate.scale_pool().block_nbytes == layout.block_nbytes


@pytest.mark.timeout(10)
@pytest.mark.parametrize("scale_layout", ["inline", "separate"])
def test_plane_views_cover_each_block_exactly_once(scale_layout: str) -> None:
    import torch

    from kvown.cache import KVPool

    layout = KVLayout.nvfp4(num_layers=3, num_blocks=5, tokens_per_block=4, num_kv_heads=2, head_dim=32,
                            scale_layout=scale_layout)
    pools = [KVPool(layout)] + ([KVPool(layout.scale_pool())] if scale_layout == "separate" else [])
    for pool in pools:
        for number, plane in enumerate(pool.layout.planes, start=1):
            view = pool.plane_view(plane.name)
            assert view.shape == (5, 2, 3, 4, plane.nbytes_per_token)
            view += number  # every byte of the plane, once
        counts = torch.bincount(pool.tensor.long(), minlength=len(pool.layout.planes) + 1)
        # Every byte belongs to exactly one plane, and each plane has its expected size.
        assert int(counts[0]) == 0
        for number, plane in enumerate(pool.layout.planes, start=1):
            assert int(counts[number]) == pool.layout.plane_block_nbytes(plane.name) * 5
        # Block 3 of a plane lies inside block 3's byte range.
        view = pool.plane_view(pool.layout.planes[-1].name)[3]
        start = view.data_ptr() - pool.base_addr
        assert 3 * pool.layout.block_nbytes <= start < 4 * pool.layout.block_nbytes
