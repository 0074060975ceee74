"""CPU reference of NVFP4: rounding, packing, scales and round trips."""

from __future__ import annotations

import pytest
import torch

from kvown.cache import KVLayout
from kvown.core.errors import LocalProtocolError
from kvown.kernels import nvfp4


@pytest.mark.timeout(10)
def test_e2m1_codes_round_to_nearest_with_ties_to_even() -> None:
    x = torch.tensor([0.0, 0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.5, -6.0, -0.1])
    expected = [0, 0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 8 | 1, 8 | 7, 0]
    assert nvfp4.encode_e2m1(x).tolist() == expected
    decoded = nvfp4.decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert decoded.tolist() == [*nvfp4.E2M1_MAGNITUDES, *(-m for m in nvfp4.E2M1_MAGNITUDES)]


@pytest.mark.timeout(10)
def test_nibble_order_is_low_first() -> None:
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = nvfp4.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(nvfp4.unpack_nibbles(packed), codes)


@pytest.mark.timeout(10)
def test_exact_round_trip_for_representable_groups() -> None:
    generator = torch.Generator().manual_seed(7)
    magnitudes = torch.tensor(nvfp4.E2M1_MAGNITUDES)
    codes = torch.randint(0, 16, (4, 3, 64), generator=generator)
    values = torch.where(codes >= 8, -magnitudes[codes % 8], magnitudes[codes % 8])
    values[..., ::16] = 6.0  # every group's amax is 6, so the group scale is a power of two
    powers = 2.0 ** torch.randint(-4, 5, (4, 3, 4, 1), generator=generator).float()
    x = (values.reshape(4, 3, 4, 16) * powers).reshape(4, 3, 64)
    q = nvfp4.quantize(x, global_scale=1.0)
    assert q.values.shape == (4, 3, 32) and q.values.dtype == torch.uint8
    assert q.scales.shape == (4, 3, 4) and q.scales.dtype == torch.uint8
    assert torch.equal(nvfp4.dequantize(q), x)


@pytest.mark.timeout(10)
def test_random_values_stay_within_the_e2m1_step_of_their_group() -> None:
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1)) * 3
    q = nvfp4.quantize(x)
    error = (nvfp4.dequantize(q) - x).abs().reshape(8, 8, 16)
    group_amax = x.abs().reshape(8, 8, 16).amax(-1, keepdim=True)
    # Largest E2M1 half-step is 1 (between 4 and 6) in units of amax/6; E4M3 scale rounding adds <= 1/16.
    assert bool((error <= group_amax / 6 * (1 + 6 / 16) + 1e-6).all())
    assert float(error.mean()) < float(x.abs().mean()) * 0.2


@pytest.mark.timeout(10)
def test_zero_groups_and_bad_input() -> None:
    q = nvfp4.quantize(torch.zeros(2, 32))
    assert int(q.values.sum()) == 0 and torch.equal(nvfp4.dequantize(q), torch.zeros(2, 32))
    with pytest.raises(LocalProtocolError):
        nvfp4.quantize(torch.zeros(2, 24))
    with pytest.raises(LocalProtocolError):
        nvfp4.quantize(torch.tensor([float("nan")] * 16))


@pytest.mark.timeout(10)
def test_quantised_bytes_fit_the_nvfp4_layout_planes() -> None:
    layout = KVLayout.nvfp4(num_layers=1, num_blocks=1, tokens_per_block=4, num_kv_heads=2, head_dim=64)
    keys = torch.randn(4, 2, 64)  # tokens, heads, head_dim
    q = nvfp4.quantize(keys)
    planes = {plane.name: plane for plane in layout.planes}
    assert q.values[0, 0].numel() == planes["k_values"].nbytes_per_token
    assert q.scales[0, 0].numel() == planes["k_scales"].nbytes_per_token
