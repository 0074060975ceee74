"""The kernels' own arithmetic (kv_math.cuh, built for the host by setup.py) against the torch reference,
bit for bit, on fixed-seed random inputs and on the edge cases: ties, saturation, zeros, negative zero,
subnormal E4M3 scales, float16 / bfloat16 inputs, MLA rope columns, odd buffer lengths.

Each comparison also has a planted bug (a mutant reference) that it must reject, so a comparison that
silently compared nothing would fail.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from kvown.kernels import blocks, nvfp4

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def host():  # type: ignore[no-untyped-def]
    try:
        return importlib.import_module("kvown.kernels._kv_host")
    except ImportError as exc:
        pytest.fail(
            f"kvown.kernels._kv_host is not built ({exc}): run `make setup` "
            "(pip install --no-deps -e .) or `python setup.py build_ext --inplace`"
        )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def host_e4m3(host, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = np.empty(x.numel(), dtype=np.uint8)
    host.e4m3_encode(x.contiguous().numpy(), out)
    return torch.from_numpy(out)


def e4m3_edges() -> torch.Tensor:
    """Every E4M3 value, the midpoints between neighbours and the floats just around each."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    mids = (values[:-1].double() + values[1:].double()) / 2  # exact in float32: one more mantissa bit
    points = torch.cat((values, mids.float()))
    up = torch.nextafter(points, torch.full_like(points, 1e9))
    down = torch.nextafter(points, torch.zeros_like(points))
    edge = torch.cat((points, up, down, torch.tensor([0.0, 2.0**-10, 2.0**-11, 1e-40, 2.0**-126])))
    return torch.cat((edge, -edge)).clamp(-448, 448)


def test_e4m3_encode_matches_torch_on_every_edge_and_random_values(host) -> None:  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(11)
    log_uniform = torch.exp2(torch.empty(200_000).uniform_(-12, 8.8, generator=generator))
    x = torch.cat((e4m3_edges(), log_uniform.clamp(max=448), -log_uniform.clamp(max=448)))
    expected = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(host_e4m3(host, x), expected)
    # Saturation and NaN (torch's own cast makes NaN above 464; the kernels clamp first, to 448).
    specials = torch.tensor([448.0, 449.0, 464.0, 500.0, 1e30, float("inf"), -1e30, float("nan")])
    assert host_e4m3(host, specials).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F]
    # Mutant: truncation instead of ties-to-even is rejected by the same inputs.
    truncated = (x.abs().view(torch.int32) & ~0xFFFFF).view(torch.float32) * x.sign()
    assert not torch.equal(host_e4m3(host, truncated), expected)


def test_e4m3_decode_matches_torch_for_all_256_codes(host) -> None:  # type: ignore[no-untyped-def]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = np.empty(256, dtype=np.float32)
    host.e4m3_decode(codes.numpy(), out)
    expected = codes.view(torch.float8_e4m3fn).float()
    got = torch.from_numpy(out)
    nan = torch.isnan(expected)
    assert nan.sum() == 2 and torch.equal(torch.isnan(got), nan)
    assert torch.equal(bits(got)[~nan], bits(expected)[~nan])  # includes -0.0 (0x80) and subnormals


def test_e2m1_encode_and_decode_match_the_reference(host) -> None:  # type: ignore[no-untyped-def]
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    around = [
        v
        for t in ties
        for v in (np.nextafter(t, 0, dtype=np.float32), t, np.nextafter(t, 9, dtype=np.float32))
    ]
    edge = torch.tensor(
        [
            0.0,
            -0.0,
            1e-45,
            -1e-45,
            6.0,
            6.5,
            1e38,
            float("inf"),
            -float("inf"),
            *around,
            *(-v for v in around),
        ],
        dtype=torch.float32,
    )
    x = torch.cat((edge, torch.empty(100_000).uniform_(-8, 8, generator=torch.Generator().manual_seed(5))))
    out = np.empty(x.numel(), dtype=np.uint8)
    host.e2m1_encode(x.numpy(), out)
    assert torch.equal(torch.from_numpy(out), nvfp4.encode_e2m1(x))
    # Mutant: ties away from zero (torch.round's neighbour, bucketize right=True) is rejected.
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    away = torch.bucketize(x.abs(), midpoints, right=True).to(torch.uint8)
    away |= ((x < 0) & (away > 0)).to(torch.uint8) << 3
    assert not torch.equal(torch.from_numpy(out), away)
    codes = torch.arange(16, dtype=torch.uint8)
    decoded = np.empty(16, dtype=np.float32)
    host.e2m1_decode(codes.numpy(), decoded)
    assert torch.equal(bits(torch.from_numpy(decoded)), bits(nvfp4.decode_e2m1(codes)))  # code 8 is -0.0


@pytest.mark.parametrize(("dtype", "name"), [(torch.bfloat16, "bf16_to_f32"), (torch.float16, "f16_to_f32")])
def test_16_bit_inputs_widen_exactly_for_all_65536_patterns(host, dtype: torch.dtype, name: str) -> None:  # type: ignore[no-untyped-def]
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    out = np.empty(65536, dtype=np.float32)
    getattr(host, name)(patterns.numpy(), out)
    expected = patterns.view(dtype).float()
    got = torch.from_numpy(out)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(bits(got)[~nan], bits(expected)[~nan])


def host_quantize(host, x: torch.Tensor, q: nvfp4.NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    rows, n = x.numel() // x.shape[-1], x.shape[-1]
    values = np.empty(rows * n // 2, dtype=np.uint8)
    scales = np.empty(rows * n // 16, dtype=np.uint8)
    code = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[x.dtype]
    data = x.contiguous().view(torch.int16) if code else x.contiguous()
    gs, rope_gs = q.group_scales()
    bad = host.quantize(data.numpy(), code, rows, n, gs, rope_gs, (n - q.rope_dim) // 16, values, scales)
    assert bad == 0
    return torch.from_numpy(values).reshape(q.values.shape), torch.from_numpy(scales).reshape(q.scales.shape)


TIES = torch.tensor(
    [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0]
)
# Rows whose amax is 6 * s, so the scale is exactly s (an E4M3 value) and every value is an exact tie.
TIES_AT_ODD_SCALES = TIES * torch.tensor(
    [[1.125], [1.25], [1.375], [1.625], [1.75], [1.875], [3.5], [0.625], [0.1875]]
)


def quantize_cases() -> list[tuple[str, torch.Tensor, dict[str, object]]]:
    g = torch.Generator().manual_seed(2024)
    ties = TIES
    normal = torch.randn(64, 128, generator=g)
    wide = torch.randn(32, 64, generator=g) * torch.exp2(torch.randint(-30, 30, (32, 1), generator=g).float())
    zeros = torch.zeros(4, 32)
    zeros[1] = -0.0
    zeros[2, 5] = 1e-30  # a lone tiny value in a zero group
    latent = torch.randn(8, 576, generator=g)
    latent[:, 512:] *= 40  # the rope part has another range
    return [
        ("normal, default scale", normal, {}),
        ("normal, gs 1", normal, {"global_scale": 1.0}),
        ("saturating scales (gs tiny)", normal * 100, {"global_scale": 1e-6}),
        ("subnormal E4M3 scales (gs large)", normal, {"global_scale": 40.0}),
        ("exact ties, gs 1", ties.repeat(4, 2), {"global_scale": 1.0}),
        (
            "ties at power-of-two scales",
            ties.repeat(3, 1) * torch.tensor([[0.125], [4.0], [2.0**-8]]),
            {"global_scale": 1.0},
        ),
        ("ties at non-power-of-two scales", TIES_AT_ODD_SCALES, {"global_scale": 1.0}),
        ("zeros and negative zeros", zeros, {}),
        ("wide dynamic range", wide, {"global_scale": 3.7e-3}),
        ("effective scale underflows", normal * 1e-38, {"global_scale": 1e-38}),
        ("bfloat16", normal.to(torch.bfloat16), {}),
        ("float16", (normal * 1000).to(torch.float16), {"global_scale": 0.5}),
        ("MLA latent 512 + 64", latent, {"rope_dim": 64}),
        (
            "MLA latent, given scales",
            latent.to(torch.bfloat16),
            {"rope_dim": 64, "global_scale": 0.01, "rope_global_scale": 0.2},
        ),
    ]


@pytest.mark.parametrize(("name", "x", "kwargs"), quantize_cases(), ids=[c[0] for c in quantize_cases()])
def test_quantize_matches_the_reference_bit_for_bit(host, name: str, x: torch.Tensor, kwargs: dict) -> None:  # type: ignore[no-untyped-def,type-arg]
    q = nvfp4.quantize(x, **kwargs)
    values, scales = host_quantize(host, x, q)
    assert torch.equal(scales, q.scales), name
    assert torch.equal(values, q.values), name
    if "subnormal" in name:
        assert bool(((q.scales > 0) & (q.scales < 8)).any())  # the case really has subnormal scales
    if "saturating" in name:
        assert bool((q.scales == 0x7E).any())


def test_quantize_comparison_rejects_division_by_reciprocal(host) -> None:  # type: ignore[no-untyped-def]
    """Mutant: x * (1 / effective) -- what torch on CUDA does for ``t / python_scalar`` -- instead of
    x / effective moves exact ties at non-power-of-two scales, and the host build sees it."""
    x = TIES_AT_ODD_SCALES
    q = nvfp4.quantize(x, 1.0)
    values, scales = host_quantize(host, x, q)
    assert torch.equal(values, q.values) and torch.equal(scales, q.scales)
    effective = q.scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    groups = x.reshape(*q.scales.shape, 16)
    mutant = nvfp4.pack_nibbles(nvfp4.encode_e2m1(groups * (1.0 / effective)).reshape(x.shape))
    assert not torch.equal(values, mutant)


def test_dequantize_matches_the_reference_bit_for_bit(host) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(77)
    rows, n = 128, 576
    values = torch.randint(0, 256, (rows, n // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 256, (rows, n // 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales[(scales & 0x7F) == 0x7F] = 0x3F  # NaN scale codes are checked below
    for gs, rope_dim, rope_gs in ((1.0, 0, None), (3.1e-5, 64, 0.37), (1e30, 0, None), (1e-40, 64, 2.0**-20)):
        q = nvfp4.NVFP4Tensor(
            values,
            scales,
            nvfp4.as_float32(gs),
            rope_dim,
            None if rope_gs is None else nvfp4.as_float32(rope_gs),
        )
        out = np.empty(rows * n, dtype=np.float32)
        a, b = q.group_scales()
        host.dequantize(values.numpy(), scales.numpy(), rows, n, a, b, (n - rope_dim) // 16, out)
        expected = nvfp4.dequantize(q).reshape(-1)
        assert torch.equal(bits(torch.from_numpy(out)), bits(expected)), gs  # -0.0 and inf included
    nan_scales = torch.full((1, 1), 0x7F, dtype=torch.uint8)
    out = np.empty(16, dtype=np.float32)
    host.dequantize(values[:1, :8].contiguous().numpy(), nan_scales.numpy(), 1, 16, 1.0, 1.0, 1, out)
    assert np.isnan(out).all()


def test_checksums_match_the_reference_across_lengths_and_chunk_boundaries(host) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    for nbytes in (0, 1, 3, 4, 5, 15, 16, 17, 4096 + 3, (1 << 20) + 5):
        data = torch.randint(0, 256, (3, nbytes), generator=g, dtype=torch.int32).to(torch.uint8)
        out = np.empty(3, dtype=np.uint64)
        host.checksums(data.numpy(), 3, nbytes, out)
        assert torch.equal(torch.from_numpy(out.view(np.int64)), blocks.checksums(data)), nbytes
    # Mutant: the same sums without the word index (position-blind) differ from the host build.
    data = torch.randint(0, 256, (1, 64), generator=g, dtype=torch.int32).to(torch.uint8)
    words = blocks._words(data)
    lane_a = int(blocks.mix32(words).sum()) & blocks.M32
    out = np.empty(1, dtype=np.uint64)
    host.checksums(data.numpy(), 1, 64, out)
    length = blocks.mix32(torch.tensor([(64 + 0x68E31DA4) & blocks.M32]))
    assert int(out[0]) & blocks.M32 != int(blocks.mix32(torch.tensor([lane_a]) ^ length))


def test_patterns_and_canary_seeds_match_the_reference(host) -> None:  # type: ignore[no-untyped-def]
    for length in (*range(0, 37), (1 << 20) + 3):
        buffer = np.zeros(length, dtype=np.uint8)
        host.pattern_fill(buffer, 0xDEADBEEF, 0x12345678)
        expected = blocks.fill_seeded(torch.zeros(length, dtype=torch.uint8), (0xDEADBEEF, 0x12345678))
        assert torch.equal(torch.from_numpy(buffer), expected), length
        assert host.pattern_first_bad(buffer, 0xDEADBEEF, 0x12345678) == -1
    buffer[777] ^= 0x10
    assert host.pattern_first_bad(buffer, 0xDEADBEEF, 0x12345678) == 777
    assert blocks.first_seeded_mismatch(torch.from_numpy(buffer), (0xDEADBEEF, 0x12345678)) == 777
    g = torch.Generator().manual_seed(8)
    pools = torch.randint(0, 1 << 32, (64,), generator=g, dtype=torch.int64)
    ids = torch.randint(0, 1 << 32, (64,), generator=g, dtype=torch.int64)
    epochs = torch.randint(0, 1 << 62, (64,), generator=g, dtype=torch.int64)
    epochs[:3] = torch.tensor([0, (1 << 32) - 1, (1 << 63) - 1])
    for pool, block, epoch in zip(pools.tolist(), ids.tolist(), epochs.tolist(), strict=True):
        a, b = blocks.canary_seeds(pool, torch.tensor([block]), torch.tensor([epoch]))
        assert host.canary_seeds(pool, block, epoch) == (int(a), int(b))
    words = torch.randint(0, 1 << 32, (4096,), generator=g, dtype=torch.int64)
    mixed = np.empty(4096, dtype=np.uint32)
    host.mix32(words.to(torch.int64).numpy().astype(np.uint32), mixed)
    assert torch.equal(torch.from_numpy(mixed.astype(np.int64)), blocks.mix32(words))
