"""Every CUDA kernel compiles to PTX with NVRTC on this GPU-less machine, with the loader's own options.

NVRTC needs no driver: the pinned ``nvidia-cuda-nvrtc-cu12`` wheel (requirements.lock) provides it in
CI. A kernel that does not compile fails here, before any GPU machine sees it.
"""

from __future__ import annotations

import re

import pytest

from kvown.kernels import cuda_loader
from kvown.kernels.nvrtc import NvrtcError, find_nvrtc

pytestmark = pytest.mark.timeout(120)

# The architectures kvown targets: Ampere (A100), Hopper (H100 / H200), Blackwell (B200).
ARCHS = ("compute_80", "compute_90", "compute_100")


@pytest.fixture(scope="module")
def nvrtc():  # type: ignore[no-untyped-def]
    found = find_nvrtc()
    if found is None:
        pytest.fail("no NVRTC library found: pip install -r requirements.lock (nvidia-cuda-nvrtc-cu12)")
    return found


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_to_ptx(nvrtc, arch: str) -> None:  # type: ignore[no-untyped-def]
    if int(arch.split("_")[1]) not in nvrtc.supported_archs():
        pytest.skip(f"NVRTC {nvrtc.version} at {nvrtc.path} does not know {arch}")
    ptx = nvrtc.compile_ptx(
        cuda_loader.kernel_source(),
        "kv_kernels.cu",
        (*cuda_loader.NVRTC_OPTIONS, f"--gpu-architecture={arch}"),
    )
    entries = re.findall(r"\.entry\s+(\w+)", ptx)
    assert sorted(entries) == sorted(cuda_loader.KERNEL_NAMES)
    # The floating-point promises of kv_math.cuh rule 1, as the PTX shows them.
    assert "fma.rn.f32" not in ptx  # --fmad=false: no contraction of a*b+c
    assert "div.approx" not in ptx and "div.full" not in ptx  # IEEE division only
    assert ".ftz" not in ptx  # denormals kept
    assert "div.rn.f32" in ptx


def test_a_kernel_that_does_not_compile_fails_with_the_log(nvrtc) -> None:  # type: ignore[no-untyped-def]
    broken = cuda_loader.kernel_source().replace("kv_u32 lo = kv_mix32", "kv_u32 lo = kv_mix32_missing", 1)
    with pytest.raises(NvrtcError) as raised:
        nvrtc.compile_ptx(broken, "kv_kernels.cu", cuda_loader.NVRTC_OPTIONS)
    assert "kv_mix32_missing" in raised.value.log


def test_nvrtc_reports_a_version(nvrtc) -> None:  # type: ignore[no-untyped-def]
    major, minor = nvrtc.version
    assert major >= 12 and minor >= 0
