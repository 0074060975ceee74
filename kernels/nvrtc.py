"""NVRTC through ctypes: compile kvown's CUDA sources to PTX on any machine, with or without a GPU.

Owns: finding a ``libnvrtc`` shared library and the handful of NVRTC calls that turn CUDA C++ into
PTX. NVRTC needs no driver and no device, so this is how CI (no GPU) proves every kernel compiles
(tests/kernels/test_ptx.py) and how ``kvown doctor`` says whether run-time compilation works.

Rules:
  1. The library is looked for, in order: ``$KVOWN_NVRTC`` (a path), the ``nvidia-cuda-nvrtc-cu12``
     wheel (``nvidia/cuda_nvrtc/lib``), the CUDA 13 ``nvidia-cuda-nvrtc`` wheel (``nvidia/cu13/lib``),
     CuPy's own copy (``cupy/.data``), ``$CUDA_PATH`` / ``$CUDA_HOME`` and ``/usr/local/cuda``, then the
     loader's search path. Whatever CUDA major version is found is fine (12 or 13).
  2. Never raises at import; ``find_nvrtc`` returns ``None`` when nothing loads.
  3. A compile error raises ``NvrtcError`` carrying NVRTC's log.

Called: by tests and ``kvown doctor``; the GPU path compiles through CuPy instead (kernels/cuda_loader.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import glob
import os
import site
import sys

_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


class NvrtcError(RuntimeError):
    """NVRTC failed; ``log`` is its compile log."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(f"{message}\n{log}" if log else message)
        self.log = log


@dataclasses.dataclass(frozen=True)
class Nvrtc:
    path: str
    lib: ctypes.CDLL

    @property
    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def supported_archs(self) -> list[int]:
        count = ctypes.c_int()
        self._check(self.lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "nvrtcGetNumSupportedArchs")
        archs = (ctypes.c_int * count.value)()
        self._check(self.lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
        return list(archs)

    def compile_ptx(self, source: str, name: str = "kernel.cu", options: tuple[str, ...] = ()) -> str:
        """PTX of ``source``. After error: ``NvrtcError`` with the compile log."""
        program = ctypes.c_void_p()
        self._check(
            self.lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None),
            "nvrtcCreateProgram",
        )
        try:
            argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = self.lib.nvrtcCompileProgram(program, len(options), argv)
            log = self._log(program)
            if status != 0:
                raise NvrtcError(f"NVRTC could not compile {name} ({self._error(status)})", log)
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetPTXSize(program, ctypes.byref(size)), "nvrtcGetPTXSize")
            ptx = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetPTX(program, ptx), "nvrtcGetPTX")
            return ptx.value.decode()
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(program))

    def _log(self, program: ctypes.c_void_p) -> str:
        size = ctypes.c_size_t()
        if self.lib.nvrtcGetProgramLogSize(program, ctypes.byref(size)) != 0 or size.value <= 1:
            return ""
        log = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(program, log)
        return log.value.decode(errors="replace")

    def _error(self, status: int) -> str:
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return (self.lib.nvrtcGetErrorString(status) or b"?").decode()

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise NvrtcError(f"{what} failed: {self._error(status)}")


def _candidates() -> list[str]:
    paths: list[str] = []
    if os.environ.get("KVOWN_NVRTC"):
        paths.append(os.environ["KVOWN_NVRTC"])
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    for root in dict.fromkeys(r for r in roots if r and os.path.isdir(r)):
        for pattern in (
            "nvidia/cuda_nvrtc/lib/libnvrtc.so*",
            "nvidia/cu13/lib/libnvrtc.so*",
            "nvidia/cu12/lib/libnvrtc.so*",
            "cupy/.data/*/lib/libnvrtc.so*",
        ):
            paths.extend(sorted(glob.glob(os.path.join(root, pattern)), reverse=True))
    for home in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
                paths.extend(os.path.join(home, sub, name) for name in _NAMES)
    found = ctypes.util.find_library("nvrtc")
    paths.extend([*([found] if found else []), *_NAMES])
    # The wheels also ship libnvrtc-builtins and an ".alt" build; only the plain library is wanted.
    return [p for p in dict.fromkeys(paths) if "builtins" not in p and ".alt." not in p]


@functools.cache
def find_nvrtc() -> Nvrtc | None:
    """The first NVRTC library that loads and answers ``nvrtcVersion``, or ``None`` (rule 2)."""
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            continue
        try:
            nvrtc = Nvrtc(path, ctypes.CDLL(path))
            nvrtc.version  # noqa: B018  (loads and answers, or raises)
        except (OSError, AttributeError, NvrtcError):
            continue
        return nvrtc
    return None
