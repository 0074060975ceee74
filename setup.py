# setup.py holds the things pyproject.toml cannot say; all other metadata lives there.
#
# 1. Packages: everything under kvown/, plus the source folder kernels/ installed as kvown.kernels
#    (package_dir). No top-level `kernels` is ever installed: Hugging Face's `kernels` package owns that
#    name, and the two must install side by side (tests/test_packaging.py).
# 2. The host test extension kvown.kernels._kv_host: kernels/cuda/kv_math.cuh compiled for the CPU, so CI
#    checks the kernels' arithmetic bit for bit without a GPU. Flags: no -ffast-math and no floating-point
#    contraction (kv_math.cuh rule 1). The CUDA kernels are compiled by NVRTC at first use, not here.
# 3. The compiled hot path (issue 19): with KVOWN_COMPILE=1, mypyc compiles COMPILED (the same .py
#    source; the list is kvown.runtime.build.HOT_PATH) into extension modules that sit beside the .py files and win the import. Default 0: an
#    editable install must stay interpreted (in-place .so files would shadow the source for every run).
#    Anything that stops the compile (no mypyc, a type error, no C compiler) falls back to pure Python
#    with a warning: it never fails the install. `kvown.build_info()` says which build runs.
import ast
import os
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


def _hot_path() -> list[str]:
    """The source files of kvown.runtime.build.HOT_PATH (read, not imported: the build needs no kvown)."""
    tree = ast.parse(Path("kvown/runtime/build.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "HOT_PATH":
            return [name.replace(".", "/") + ".py" for name in ast.literal_eval(node.value)]
    raise RuntimeError("kvown/runtime/build.py has no HOT_PATH")


# the packages a compiled module may sit in (a stale .so there would win the import); kernels/ is not one
_HOT_PACKAGES = ("adapters", "cache", "core", "runtime")


MYPYC_GROUP = "kvown_hot"  # the shared library is kvown_hot__mypyc; each module gets a small shim


def _warn(text: str) -> None:
    print(f"kvown setup: {text}; installing the interpreted build", file=sys.stderr)


def _mypyc_extensions() -> list[Extension]:
    if os.environ.get("KVOWN_COMPILE", "0") != "1":
        return []
    if not {"bdist_wheel", "build_ext", "build", "install"} & set(sys.argv[1:]):
        return []  # metadata and editable steps: mypyc's type check + C generation only where it builds
    try:
        from mypyc.build import mypycify
    except ImportError:
        _warn("KVOWN_COMPILE=1 but mypyc is not importable")
        return []
    try:
        return list(mypycify(_hot_path(), opt_level="3", group_name=MYPYC_GROUP))
    except (Exception, SystemExit) as e:  # mypycify exits on a type error
        _warn(f"mypyc refused the source ({e!r})")
        return []


class BuildExt(build_ext):
    """Builds the mypyc group first and all or nothing: a failed C compile drops every compiled module
    (a shim without its shared library would break the import), never the install."""

    def build_extensions(self) -> None:
        self._drop_stale_compiled()
        compiled = [e for e in self.extensions if getattr(e, "_kvown_mypyc", False)]
        others = [e for e in self.extensions if e not in compiled]
        if compiled and (self.inplace or getattr(self, "editable_mode", False)):
            _warn("an editable/in-place build stays interpreted (a .so beside the .py would shadow it)")
            compiled = []
        try:
            for ext in compiled:
                self.build_extension(ext)
        except Exception as e:  # CompileError, LinkError, a missing compiler
            _warn(f"the C compile of the mypyc modules failed ({e!r})")
            for ext in compiled:
                path = self.get_ext_fullpath(ext.name)
                if os.path.exists(path):
                    os.remove(path)
        for ext in others:
            self.build_extension(ext)

    def _drop_stale_compiled(self) -> None:
        """Remove compiled modules an earlier build left in build/lib: the wheel takes everything there,
        so an interpreted build (or a shorter HOT_PATH) would otherwise ship a stale .so that wins."""
        root = Path(self.build_lib)
        for path in [*root.glob("kvown_hot__mypyc*"), *(p for sub in _HOT_PACKAGES for p in root.glob(f"kvown/{sub}/*.so"))]:
            path.unlink()


def _tag(exts: list[Extension]) -> list[Extension]:
    for ext in exts:
        ext._kvown_mypyc = True  # type: ignore[attr-defined]
    return exts


setup(
    packages=[*find_packages(include=["kvown", "kvown.*"]), "kvown.kernels"],
    package_dir={"kvown.kernels": "kernels"},
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "kvown.kernels._kv_host",
            sources=["kernels/host/kv_host.cpp"],
            include_dirs=["kernels/cuda"],
            depends=["kernels/cuda/kv_math.cuh"],
            extra_compile_args=["-std=c++17", "-O2", "-ffp-contract=off", "-fno-fast-math"],
            language="c++",
        ),
        *_tag(_mypyc_extensions()),
    ],
)
