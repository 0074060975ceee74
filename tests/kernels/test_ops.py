"""kvown.kernels.ops on CPU tensors: dispatch to the reference, writes into pool planes of both NVFP4 scale
layouts, canaries over many blocks, and ValueError naming the argument for every malformed input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvown.cache import KVLayout, KVPool
from kvown.kernels import blocks, nvfp4, ops
from kvown.kernels.errors import KernelInputError

pytestmark = pytest.mark.timeout(60)


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scale_layout", ["inline", "separate"])
def test_quantize_into_pool_planes_and_back(scale_layout: str) -> None:
    layout = KVLayout.nvfp4(
        num_layers=2, num_blocks=6, tokens_per_block=8, num_kv_heads=2, head_dim=64, scale_layout=scale_layout
    )
    pool = KVPool(layout)
    scale_pool = KVPool(layout.scale_pool()) if scale_layout == "separate" else pool
    blocks_written = [1, 4]
    for name in ("k", "v"):
        x = rand(2, 2, 2, 8, 64, seed=ord(name)).to(torch.bfloat16)  # blocks, heads, layers, tokens, dim
        values = pool.plane_view(f"{name}_values")[blocks_written]  # a copy (advanced indexing)...
        # ...so write through basic slices of the strided views instead: blocks 1 and 4 separately.
        for index, block in enumerate(blocks_written):
            out = (pool.plane_view(f"{name}_values")[block], scale_pool.plane_view(f"{name}_scales")[block])
            q = ops.quantize(x[index], 0.01, out=out)
            assert q.values.data_ptr() == out[0].data_ptr()
            reference = nvfp4.quantize(x[index], 0.01)
            assert torch.equal(out[0], reference.values) and torch.equal(out[1], reference.scales)
            landed = nvfp4.NVFP4Tensor(
                pool.plane_view(f"{name}_values")[block], scale_pool.plane_view(f"{name}_scales")[block], 0.01
            )
            assert torch.equal(ops.dequantize(landed), nvfp4.dequantize(reference))
        assert values.shape == (2, 2, 2, 8, 32)
    untouched = [b for b in range(6) if b not in blocks_written]
    assert all(int(pool.block_view(b).sum()) == 0 for b in untouched)
    assert all(int(pool.block_view(b).sum()) > 0 for b in blocks_written)


def test_mla_latent_rope_columns_use_their_own_scale() -> None:
    latent = rand(16, 576, seed=4)
    latent[:, 512:] *= 50
    q = ops.quantize(latent, rope_dim=64)
    assert q.rope_dim == 64 and q.rope_global_scale is not None
    assert q.rope_global_scale > 20 * q.global_scale
    error = (ops.dequantize(q) - latent).abs()
    assert float(error[:, :512].max()) < 0.5 and float(error[:, 512:].max()) < 25


def test_cpu_tensors_run_the_reference_and_cuda_backend_needs_cuda_tensors() -> None:
    x = rand(4, 32)
    assert torch.equal(ops.quantize(x).values, nvfp4.quantize(x).values)
    with pytest.raises(ValueError, match="CUDA") as raised:
        ops.quantize(x, backend="cuda")
    assert raised.value.fields["field"] == "backend"  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        ops.checksums(torch.zeros(2, 8, dtype=torch.uint8), backend="gpu")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rope_dim", [0, 64])
def test_the_host_build_gives_the_references_bits(dtype: torch.dtype, rope_dim: int) -> None:
    """CPU tensors run the host build of the kernel math by default: the reference's bits, ~100x faster."""
    pytest.importorskip("kvown.kernels._kv_host", reason="the host build is made by `make setup`")
    x = (rand(3, 5, 576, seed=rope_dim) * 40).to(dtype)
    want = nvfp4.quantize(x, rope_dim=rope_dim)
    for backend in ("auto", "host"):
        got = ops.quantize(x, rope_dim=rope_dim, backend=backend)
        assert torch.equal(got.values, want.values) and torch.equal(got.scales, want.scales)
        assert (got.global_scale, got.rope_global_scale) == (want.global_scale, want.rope_global_scale)
        assert torch.equal(bits(ops.dequantize(got, backend=backend)), bits(nvfp4.dequantize(want)))


def test_the_host_build_writes_nothing_on_non_finite_input() -> None:
    pytest.importorskip("kvown.kernels._kv_host", reason="the host build is made by `make setup`")
    x = rand(2, 32)
    x[1, 7] = float("inf")
    out = (torch.full((2, 16), 0xAB, dtype=torch.uint8), torch.full((2, 2), 0xCD, dtype=torch.uint8))
    with pytest.raises(KernelInputError, match="non-finite"):
        ops.quantize(x, 1.0, out=out, backend="host")
    assert bool((out[0] == 0xAB).all()) and bool((out[1] == 0xCD).all())


def test_without_the_host_build_auto_runs_the_reference_and_host_is_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(ops, "_host_build", lambda: None)
    x = rand(4, 32)
    assert torch.equal(ops.quantize(x, 0.5).values, nvfp4.quantize(x, 0.5).values)
    with pytest.raises(KernelInputError) as raised:
        ops.quantize(x, backend="host")
    assert raised.value.fields["field"] == "backend"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: ops.quantize(torch.zeros(2, 32, dtype=torch.float64)), "x"),
        (lambda: ops.quantize(torch.zeros(2, 32, dtype=torch.int32)), "x"),
        (lambda: ops.quantize([1.0] * 16), "x"),  # type: ignore[arg-type]
        (lambda: ops.quantize(torch.zeros(2, 24)), "x"),
        (lambda: ops.quantize(torch.zeros(2, 0)), "x"),
        (lambda: ops.quantize(torch.tensor([float("nan")] * 16)), "x"),
        (lambda: ops.quantize(torch.tensor([float("inf")] * 16), 1.0), "x"),
        (lambda: ops.quantize(torch.ones(16), float("nan")), "global_scale"),
        (lambda: ops.quantize(torch.ones(16), float("inf")), "global_scale"),
        (lambda: ops.quantize(torch.ones(16), 0.0), "global_scale"),
        (lambda: ops.quantize(torch.ones(16), -1.0), "global_scale"),
        (lambda: ops.quantize(torch.ones(16), 1e-50), "global_scale"),  # 0 as a float32
        (lambda: ops.quantize(torch.ones(16), 1e39), "global_scale"),  # inf as a float32
        (lambda: ops.quantize(torch.ones(16), "1"), "global_scale"),  # type: ignore[arg-type]
        (lambda: ops.quantize(torch.ones(64), rope_dim=8), "rope_dim"),
        (lambda: ops.quantize(torch.ones(64), rope_dim=64), "rope_dim"),
        (lambda: ops.quantize(torch.ones(64), rope_global_scale=1.0), "rope_global_scale"),
        (lambda: ops.quantize(torch.ones(64), rope_dim=16, rope_global_scale=math.nan), "rope_global_scale"),
        (
            lambda: ops.quantize(
                torch.ones(2, 32),
                out=(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8)),
            ),
            "out_scales",
        ),
        (
            lambda: ops.quantize(
                torch.ones(2, 32),
                out=(torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 2, dtype=torch.uint8)),
            ),
            "out_values",
        ),
        (
            lambda: ops.dequantize(
                nvfp4.NVFP4Tensor(
                    torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), 1.0
                )
            ),
            "scales",
        ),
        (
            lambda: ops.dequantize(
                nvfp4.NVFP4Tensor(
                    torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), float("nan")
                )
            ),
            "global_scale",
        ),
        (lambda: ops.dequantize(nvfp4.NVFP4Tensor(torch.zeros(2, 8), torch.zeros(2, 1), 1.0)), "values"),
        (lambda: ops.dequantize((1, 2)), "q"),  # type: ignore[arg-type]
        (lambda: ops.checksums(torch.zeros(16, dtype=torch.uint8)), "blocks"),
        (lambda: ops.checksums(torch.zeros(4, 16, dtype=torch.uint8), [0, 4]), "block_ids"),
        (lambda: ops.fill_pattern(torch.zeros(16), 1, 0, 0), "tensor"),
        (lambda: ops.fill_canary(torch.zeros(4, 16, dtype=torch.uint8), [1], -1, 0), "pool_id"),
        (lambda: ops.fill_canary(torch.zeros(4, 16, dtype=torch.uint8), [1], 1 << 32, 0), "pool_id"),
        (lambda: ops.fill_canary(torch.zeros(4, 16, dtype=torch.uint8), [1, 2], 0, [3]), "epoch"),
        (lambda: ops.verify_canary(torch.zeros(4, 16, dtype=torch.uint8)[:, ::2], [1], 0, 0), "blocks"),
    ],
)
def test_malformed_input_raises_value_error_naming_it(call, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as raised:
        call()
    assert isinstance(raised.value, KernelInputError)
    assert raised.value.fields["field"] == field, str(raised.value)


def test_leading_dims_merge_to_at_most_four() -> None:
    x = torch.zeros(3, 4, 5, 6, 7, 16)
    sizes, strides = ops._leading_dims(x.shape[:-1], [x], "x")
    assert sizes == [1, 1, 1, 3 * 4 * 5 * 6 * 7] and strides == [[0, 0, 0, 16]]
    layout = KVLayout.nvfp4(num_layers=2, num_blocks=3, tokens_per_block=4, num_kv_heads=2, head_dim=32)
    plane = KVPool(layout).plane_view("v_scales")
    sizes, strides = ops._leading_dims(plane.shape[:-1], [plane], "x")
    assert sizes == [1, 1, 3 * 2 * 2, 4]  # blocks, heads and layers merge; tokens of one plane do not
    # Rows visited in order land where the strided view says.
    offsets = {
        sum(i * s for i, s in zip(index, strides[0], strict=True))
        for index in torch.cartesian_prod(*(torch.arange(n) for n in sizes)).tolist()
    }
    assert offsets == {
        plane[b, h, layer, t].data_ptr() - plane.data_ptr()
        for b in range(3)
        for h in range(2)
        for layer in range(2)
        for t in range(4)
    }
    six = torch.zeros(2, 3, 4, 5, 6, 32)[:, ::2, :, ::2, :, ::2][..., :16]
    with pytest.raises(ValueError) as raised:
        ops._leading_dims(six.shape[:-1], [six, six[..., :1]], "x")
    assert raised.value.fields["field"] == "x"  # type: ignore[attr-defined]


def test_canaries_catch_a_planted_late_write_at_its_offset() -> None:
    pool = torch.zeros(8, 4100, dtype=torch.uint8)  # an odd block size: a partial last word
    retired = [1, 2, 6]
    ops.fill_canary(pool, retired, pool_id=7, epoch=41)
    assert ops.verify_canary(pool, retired, 7, 41).tolist() == [-1, -1, -1]
    assert int(pool[0].sum()) == 0 and int(pool[3].sum()) == 0  # other blocks untouched
    assert not torch.equal(pool[1], pool[2])  # each block has its own canary
    pool[6, 4099] ^= 1  # a late WRITE lands on the last byte of block 6
    pool[2, 1234] = pool[2, 1234] ^ 0xFF
    assert ops.verify_canary(pool, retired, 7, 41).tolist() == [-1, 1234, 4099]
    # The canary is specific to the epoch and the pool: a stale canary is not a fresh one.
    assert ops.verify_canary(pool, [1], 7, 42).tolist() != [-1]
    assert ops.verify_canary(pool, [1], 8, 41).tolist() != [-1]
    epochs = torch.tensor([5, 6, 7], dtype=torch.int64)
    ops.fill_canary(pool, torch.tensor(retired), 7, epochs)
    assert ops.verify_canary(pool, retired, 7, [5, 6, 7]).tolist() == [-1, -1, -1]
    assert ops.verify_canary(pool, retired, 7, 6).tolist()[1] == -1


def test_checksums_of_chosen_blocks_equal_those_of_the_whole_pool() -> None:
    pool = torch.randint(0, 256, (6, 1000), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    pool = pool.to(torch.uint8)
    every = ops.checksums(pool)
    assert ops.checksums(pool, [4, 1]).tolist() == [int(every[4]), int(every[1])]
    assert blocks.to_uint64(int(every[0])) == ops.checksum(pool[0])
    assert len(set(every.tolist())) == 6


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(1, 300), data=st.data())
def test_changing_any_one_word_always_changes_the_checksum(nbytes: int, data: st.DataObject) -> None:
    """Invariant 1 of kvown.kernels.blocks, over many sizes and positions (not a probabilistic claim)."""
    seed = data.draw(st.integers(0, 2**31))
    block = torch.randint(
        0, 256, (1, nbytes), generator=torch.Generator().manual_seed(seed), dtype=torch.int32
    )
    block = block.to(torch.uint8)
    word = data.draw(st.integers(0, (nbytes - 1) // 4))
    changed = block.clone()
    span = changed[0, 4 * word : 4 * word + 4]
    delta = data.draw(st.lists(st.integers(0, 255), min_size=span.numel(), max_size=span.numel()).filter(any))
    span ^= torch.tensor(delta, dtype=torch.uint8)
    assert int(blocks.checksums(changed)[0]) != int(blocks.checksums(block)[0])


def test_a_missing_global_scale_over_non_finite_values_blames_x() -> None:
    x = torch.ones(2, 32)
    x[1, 3] = float("inf")
    with pytest.raises(KernelInputError) as raised:
        nvfp4.resolve_scales(x, None, 0, None)  # the CUDA path asks this before launching
    assert raised.value.fields["field"] == "x"
