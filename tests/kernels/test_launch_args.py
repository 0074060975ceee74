"""The CUDA launches of kernels/ops.py, checked without a GPU: every argument tuple the wrappers build
matches its kernel's C signature in kv_kernels.cu (count, and the exact C type each NumPy scalar
becomes), so a GPU machine never meets a misaligned parameter list.

CuPy passes each argument by value with the size of its type: an int64 given for an ``int`` shifts
every later parameter. The launch is intercepted (``ops._launch``), the tensors stand in as pointers.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kvown.kernels import cuda_loader, nvfp4, ops

pytestmark = pytest.mark.timeout(60)

POINTER = object()  # what _dl returns here: a device pointer argument
C_TYPES = {
    "int": np.int32,
    "long long": np.int64,
    "unsigned long long": np.uint64,
    "kv_u32": np.uint32,
    "float": np.float32,
}


def signatures() -> dict[str, list[str]]:
    source = cuda_loader.KERNELS.read_text()
    found = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+)\((.*?)\)\s*\{', source, re.S):
        types = []
        for param in params.split(","):
            declaration = " ".join(param.split())
            kind = "pointer" if "*" in declaration else declaration.rsplit(" ", 1)[0].replace("const ", "")
            types.append(kind)
        found[name] = types
    return found


def check(name: str, args: tuple[object, ...]) -> None:
    expected = signatures()[name]
    assert len(args) == len(expected), (name, len(args), len(expected))
    for index, (arg, kind) in enumerate(zip(args, expected, strict=True)):
        if kind == "pointer":  # a tensor, or a NULL passed as an 8-byte integer
            assert arg is POINTER or type(arg) is np.uint64, (name, index, arg)
        else:
            assert type(arg) is C_TYPES[kind], (name, index, kind, type(arg))


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...]]]:
    seen: list[tuple[str, tuple[int, ...]]] = []

    def fake_launch(device: torch.device, name: str, grid: tuple[int, ...], args) -> None:  # type: ignore[no-untyped-def]
        check(name, args())
        assert all(isinstance(g, int) and g >= 1 for g in grid) and len(grid) <= 2
        seen.append((name, grid))

    monkeypatch.setattr(ops, "_use_cuda", lambda tensor, backend: True)
    monkeypatch.setattr(ops, "_launch", fake_launch)
    monkeypatch.setattr(ops, "_dl", lambda tensor: POINTER)
    return seen


def test_the_signature_parser_sees_every_kernel() -> None:
    found = signatures()
    assert sorted(found) == sorted(cuda_loader.KERNEL_NAMES)
    assert found["kv_checksum_finish"] == ["pointer", "long long", "unsigned long long", "pointer"]


def test_every_wrapper_builds_arguments_that_match_its_kernel(launches) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(4, 3, 576).to(torch.bfloat16)
    q = ops.quantize(x, 0.5, rope_dim=64, rope_global_scale=2.0)
    ops.quantize(torch.randn(8, 32), 1.0)
    ops.dequantize(q)
    pool = torch.zeros(6, 4096, dtype=torch.uint8)
    ops.checksums(pool)
    ops.checksums(pool, [5, 1])
    ops.checksum(torch.zeros(100, dtype=torch.uint8))
    ops.fill_pattern(pool[0], "r", 1, 2)
    ops.first_pattern_mismatch(pool[0], "r", 1, 2)
    ops.fill_canary(pool, [0, 3], 9, 4)
    ops.verify_canary(pool, [0, 3], 9, [4, 5])
    names = [name for name, _ in launches]
    assert names == [
        "kv_nvfp4_quantize", "kv_nvfp4_quantize", "kv_nvfp4_dequantize",
        "kv_checksum_lanes", "kv_checksum_finish", "kv_checksum_lanes", "kv_checksum_finish",
        "kv_checksum_lanes", "kv_checksum_finish",
        "kv_pattern_fill", "kv_pattern_verify", "kv_pattern_fill", "kv_pattern_verify",
    ]  # fmt: skip
    assert launches[0][1] == ((12 * 36 + ops.THREADS - 1) // ops.THREADS,)  # one thread per group of 16


def test_a_wrong_argument_type_is_caught(launches, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Mutant: a Python int (CuPy sends int64) where the kernel takes an int is rejected."""
    original = np.int32
    monkeypatch.setattr(ops.np, "int32", lambda value: np.int64(value))
    with pytest.raises(AssertionError):
        ops.quantize(torch.randn(8, 32), 1.0)
    monkeypatch.setattr(ops.np, "int32", original)
    ops.quantize(torch.randn(8, 32), 1.0)


def test_quantize_resolves_scales_before_the_launch(launches) -> None:  # type: ignore[no-untyped-def]
    q = ops.quantize(torch.full((2, 32), 3.0), rope_dim=16)
    assert q.global_scale == nvfp4.default_global_scale(3.0) and q.rope_global_scale == q.global_scale
