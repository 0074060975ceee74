"""The CUDA launches of kernels/ops.py, checked without a GPU: every argument tuple the wrappers build
matches its kernel's C signature in kv_kernels.cu (count, and the exact C type each NumPy scalar
becomes), and every pointer argument is the tensor the kernel's parameter names, so a GPU machine
never meets a misaligned parameter list or two same-typed tensors swapped.

CuPy passes each argument by value with the size of its type: an int64 given for an ``int`` shifts
every later parameter. The launch is intercepted (``ops._launch``); each tensor stands in as a
``Pointer`` to itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from kernelsig import signatures

from kvown.kernels import cuda_loader, nvfp4, ops

pytestmark = pytest.mark.timeout(60)

C_TYPES = {
    "int": np.int32,
    "long long": np.int64,
    "unsigned long long": np.uint64,
    "kv_u32": np.uint32,
    "float": np.float32,
}


@dataclass(frozen=True, eq=False)
class Pointer:
    """What ``_dl`` returns here: a device pointer argument, remembering its tensor."""

    tensor: torch.Tensor


def check(name: str, args: tuple[object, ...]) -> dict[str, Any]:
    """Types and count against the signature; returns the arguments by parameter name."""
    expected = signatures()[name]
    assert len(args) == len(expected), (name, len(args), len(expected))
    for index, (arg, (kind, _)) in enumerate(zip(args, expected, strict=True)):
        if kind == "pointer":  # a tensor, or a NULL passed as an 8-byte integer
            assert isinstance(arg, Pointer) or type(arg) is np.uint64, (name, index, arg)
        else:
            assert type(arg) is C_TYPES[kind], (name, index, kind, type(arg))
    return {pname: arg for (_, pname), arg in zip(expected, args, strict=True)}


Launch = tuple[str, tuple[int, ...], dict[str, Any]]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    seen: list[Launch] = []

    def fake_launch(device: torch.device, name: str, grid: tuple[int, ...], args) -> None:  # type: ignore[no-untyped-def]
        named = check(name, args())
        assert all(isinstance(g, int) and g >= 1 for g in grid) and len(grid) <= 2
        seen.append((name, grid, named))

    monkeypatch.setattr(ops, "_use_cuda", lambda tensor, backend: True)
    monkeypatch.setattr(ops, "_launch", fake_launch)
    monkeypatch.setattr(ops, "_dl", Pointer)
    return seen


def test_the_signature_parser_sees_every_kernel() -> None:
    found = signatures()
    assert sorted(found) == sorted(cuda_loader.KERNEL_NAMES)
    assert found["kv_checksum_finish"] == [("pointer", "lanes"), ("long long", "nblocks"),
                                           ("unsigned long long", "nbytes"), ("pointer", "out")]


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
    names = [name for name, _, _ in launches]
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


def _tensor(arg: Any) -> torch.Tensor:
    assert isinstance(arg, Pointer), arg
    return arg.tensor


def check_pointers(launches: list[Launch], x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                   out: torch.Tensor, rows: torch.Tensor) -> None:
    """Each pointer parameter of each launch below holds the tensor its name says."""
    (_, _, q), (_, _, dq), (_, _, lanes), (_, _, finish), (_, _, verify) = launches
    assert _tensor(q["x"]) is x and _tensor(q["values"]) is values and _tensor(q["scales"]) is scales
    assert _tensor(q["bad_input"]).dtype == torch.int32 and _tensor(q["bad_input"]).numel() == 1
    assert _tensor(dq["values"]) is values and _tensor(dq["scales"]) is scales and _tensor(dq["out"]) is out
    assert _tensor(lanes["base"]) is rows and _tensor(lanes["ids"]).tolist() == [5, 1]
    assert _tensor(lanes["lanes"]) is _tensor(finish["lanes"]) and _tensor(finish["lanes"]).numel() == 4
    assert _tensor(finish["out"]).dtype == torch.int64 and _tensor(finish["out"]).numel() == 2
    assert _tensor(verify["base"]) is rows and _tensor(verify["ids"]).tolist() == [0, 3]
    assert _tensor(verify["epochs"]).tolist() == [4, 5] and _tensor(verify["first_bad"]).tolist() == [-1, -1]


def launch_all(launches: list[Launch]) -> tuple[torch.Tensor, ...]:
    x = torch.randn(4, 3, 64)
    values, scales = torch.empty(4, 3, 32, dtype=torch.uint8), torch.empty(4, 3, 4, dtype=torch.uint8)
    ops.quantize(x, 0.5, out=(values, scales), check_finite=False)
    out = torch.empty(4, 3, 64)
    ops.dequantize(nvfp4.NVFP4Tensor(values, scales, 0.5), out=out)
    rows = torch.zeros(6, 4096, dtype=torch.uint8)
    ops.checksums(rows, [5, 1])
    ops.verify_canary(rows, [0, 3], 9, [4, 5])
    return x, values, scales, out, rows


def test_every_pointer_argument_is_the_tensor_its_parameter_names(launches: list[Launch]) -> None:
    check_pointers(launches, *launch_all(launches))


@pytest.mark.parametrize(("kernel", "a", "b"), [
    ("kv_nvfp4_quantize", "values", "scales"),
    ("kv_nvfp4_dequantize", "values", "scales"),
    ("kv_pattern_verify", "ids", "epochs"),
])
def test_mutant_two_swapped_tensors_of_one_type_are_caught(launches: list[Launch], kernel: str, a: str,
                                                           b: str) -> None:
    """Same dtype, same kind of parameter: the type check alone passes them; the names do not."""
    tensors = launch_all(launches)
    named = next(named for name, _, named in launches if name == kernel)
    assert _tensor(named[a]).dtype == _tensor(named[b]).dtype
    named[a], named[b] = named[b], named[a]
    with pytest.raises(AssertionError):
        check_pointers(launches, *tensors)
