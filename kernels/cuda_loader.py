"""Load kvown's CUDA kernels with CuPy: one source, compiled by NVRTC at first use, cached per device.

Owns: the kernel source text (kv_math.cuh pasted in front of kv_kernels.cu), the NVRTC options, the
one ``cupy.RawModule`` (CuPy caches its binary per device), and zero-copy views of torch tensors as
CuPy arrays (DLPack).

Rules:
  1. ``cupy`` is imported only when a CUDA kernel is first needed, so importing ``kernels`` works on
     machines without CuPy. Which CuPy build is installed (cupy-cuda12x or cupy-cuda13x) does not
     matter: nothing here names a CUDA version, and CuPy picks the target architecture itself.
  2. The header is pasted into the source rather than ``#include``d: CuPy's compile cache keys on
     the source text, so a header change can never reuse a stale binary.
  3. Kernels run on torch's current stream for the tensor's device (``ExternalStream``), so they are
     ordered with the torch work around them; nothing here synchronises unless it must read a result.
  4. ``NVRTC_OPTIONS`` pin the floating-point behaviour the host build also has (kv_math.cuh rule 1);
     tests/kernels/test_ptx.py compiles ``kernel_source()`` with exactly these options.

Called: from kernels/ops.py, on the calling thread; the module is built once per process.
"""

from __future__ import annotations

import functools
import importlib
import pathlib
import threading
from typing import Any

CUDA_DIR = pathlib.Path(__file__).resolve().parent / "cuda"
HEADER = CUDA_DIR / "kv_math.cuh"
KERNELS = CUDA_DIR / "kv_kernels.cu"

NVRTC_OPTIONS: tuple[str, ...] = (
    "--std=c++14",
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
)
KERNEL_NAMES: tuple[str, ...] = (
    "kv_nvfp4_quantize",
    "kv_nvfp4_dequantize",
    "kv_checksum_lanes",
    "kv_checksum_finish",
    "kv_pattern_fill",
    "kv_pattern_verify",
)

_lock = threading.Lock()
_kernels: dict[str, Any] = {}


def kernel_source() -> str:
    """The complete CUDA source that NVRTC compiles (rule 2)."""
    kernels = KERNELS.read_text()
    return f"// ---- {HEADER.name} ----\n{HEADER.read_text()}\n// ---- {KERNELS.name} ----\n{kernels}"


@functools.cache
def cupy_module() -> Any:
    """``import cupy`` (rule 1). After error: ``ModuleNotFoundError`` naming the extras to install."""
    try:
        return importlib.import_module("cupy")
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "CuPy is not installed: pip install 'kvown[gpu]' (CUDA 12) or 'kvown[gpu-cu13]' (CUDA 13)"
        ) from exc


def installed_cupy() -> tuple[str, str] | None:
    """(distribution name, version) of the installed CuPy build, without importing it; or None."""
    import importlib.metadata

    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def kernel(name: str) -> Any:
    """The ``cupy.RawKernel`` ``name``. CuPy compiles the module for a device the first time a kernel
    is launched there (inside ``with cupy.cuda.Device(i)``) and caches it in memory and on disk."""
    with _lock:
        if not _kernels:
            cupy = cupy_module()
            module = cupy.RawModule(code=kernel_source(), options=NVRTC_OPTIONS)
            _kernels.update({n: module.get_function(n) for n in KERNEL_NAMES})
    return _kernels[name]


def stream(device_index: int) -> Any:
    """torch's current stream on that device, as a CuPy stream (rule 3)."""
    import torch

    cupy = cupy_module()
    return cupy.cuda.ExternalStream(torch.cuda.current_stream(device_index).cuda_stream, device_index)


def as_cupy(tensor: Any) -> Any:
    """A CuPy array over the same memory as ``tensor`` (DLPack; no copy)."""
    return cupy_module().from_dlpack(tensor)
