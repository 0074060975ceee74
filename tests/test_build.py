"""The two builds of the hot path (issue 19 item 2): compiled (mypyc) and interpreted, from one source.

`make test` runs the fast suite against the compiled build (KVOWN_EXPECT_BUILD=compiled, the build first on
sys.path) and tests/core + tests/sim against the interpreted one (KVOWN_EXPECT_BUILD=interpreted). These
tests say that each run imports the build it claims, that a source tree shadowing the build is caught, and
that both builds drive the simulator to the very same counters and decision log, seed by seed.
"""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import kvown
from kvown.runtime.build import HOT_PATH, build_info, is_compiled, libpython_linkage

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPILED_DIR = pathlib.Path(os.environ.get("KVOWN_COMPILED_DIR", ROOT / "build" / "compiled"))
SEEDS = 40


def _compiled_dir() -> pathlib.Path:
    shim = COMPILED_DIR / "kvown" / "core"
    if not any(shim.glob("receiver.*.so")):
        pytest.skip(f"no compiled build at {COMPILED_DIR} (make build-compiled, or KVOWN_COMPILE=1 pip install)")
    return COMPILED_DIR


def _child(code: str, pythonpath: pathlib.Path, *, safe_path: bool = True) -> str:
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "PYTHONHASHSEED": "0"}
    env.pop("PYTHONSAFEPATH", None)
    if safe_path:
        env["PYTHONSAFEPATH"] = "1"  # the cwd (a checkout) must not come before the build on sys.path
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.timeout(60)
def test_this_run_imports_the_build_it_expects() -> None:
    info = build_info()
    assert info["build"] != "mixed", info
    expected = os.environ.get("KVOWN_EXPECT_BUILD")
    if expected is None:
        pytest.skip("KVOWN_EXPECT_BUILD not set (make test sets it for each of its runs)")
    assert info["build"] == expected, info
    if expected == "compiled":
        import kvown.core.receiver

        assert kvown.core.receiver.__file__.endswith(".so") and not kvown.__file__.startswith(str(ROOT / "kvown"))


@pytest.mark.timeout(60)
def test_setup_compiles_exactly_the_hot_path() -> None:
    tree = ast.parse((ROOT / "setup.py").read_text())
    namespace: dict[str, object] = {"ast": ast, "Path": pathlib.Path}
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_hot_path")
    exec(compile(ast.Module([fn], []), "setup.py", "exec"), namespace)
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        files = namespace["_hot_path"]()  # type: ignore[operator]
    finally:
        os.chdir(cwd)
    assert files == [name.replace(".", "/") + ".py" for name in HOT_PATH]
    assert all((ROOT / f).exists() for f in files)


@pytest.mark.timeout(300)
def test_the_compiled_build_is_what_a_compiled_run_imports() -> None:
    build = _compiled_dir()
    code = "import kvown; print(kvown.build_info()['build'], kvown.__file__)"
    build_name, path = _child(code, build).split()
    assert build_name == "compiled" and path.startswith(str(build)), (build_name, path)
    # The mutant: the checkout's cwd first on sys.path (what `python -m pytest` from the root does without
    # PYTHONSAFEPATH) shadows the build; build_info must say so instead of claiming "compiled".
    shadowed, path = _child(code, build, safe_path=False).split()
    assert shadowed == "interpreted" and path.startswith(str(ROOT / "kvown")), (shadowed, path)


SIM_DIGEST = f"""
import json
from kvown.testing.sim import SimWorld
out = []
for seed in range({SEEDS}):
    world = SimWorld(seed)
    counters = world.run()
    out.append([seed, sorted(counters.items()), list(world.log)])
import kvown
print(kvown.build_info()['build'])
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_both_builds_drive_the_simulator_to_the_same_decisions() -> None:
    build = _compiled_dir()
    compiled = _child(SIM_DIGEST, build).split("\n", 1)
    interpreted = _child(SIM_DIGEST, ROOT).split("\n", 1)
    assert (compiled[0], interpreted[0]) == ("compiled", "interpreted")
    assert compiled[1] == interpreted[1]  # every seed: the same counters and the same decision log


def test_is_compiled_reads_the_imported_file() -> None:
    assert is_compiled("kvown.runtime.build") is False  # never compiled: not in HOT_PATH
    assert "kvown.runtime.build" not in HOT_PATH and kvown.build_info() == build_info()


@pytest.mark.timeout(60)
def test_libpython_linkage_reads_what_is_mapped() -> None:
    shared = "7f1e2000-7f1e3000 r-xp 0 fd:00 42 /root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0\n"
    static = "55d0c000-55d0d000 r-xp 0 fd:00 7 /usr/bin/python3.11\n7f00-7f01 r-xp 0 fd:00 9 /lib/libc.so.6\n"
    assert libpython_linkage(shared) == "shared"
    assert libpython_linkage(static) == "static"
    assert libpython_linkage(None) == "unknown"


def _interpreters() -> dict[str, str]:
    """Each distinct Python executable (by real path): this run's, those in /usr/bin and /usr/local/bin."""
    found = {os.path.realpath(sys.executable): sys.executable}
    for name in ("python3", "python3.11", "python3.12", "python3.13"):
        for directory in ("/usr/bin", "/usr/local/bin"):
            path = shutil.which(name, path=directory)
            if path is not None:
                found.setdefault(os.path.realpath(path), path)
    return found


@pytest.mark.timeout(120)
def test_interpreter_linkage_agrees_with_the_dynamic_linker() -> None:
    """Read live in each interpreter here (build.py is standard library only, rule 2), against ``ldd`` of its
    executable: a libpython the loader links is the one the process maps."""
    if shutil.which("ldd") is None or not pathlib.Path("/proc/self/maps").exists():
        pytest.skip("needs ldd and /proc (Linux)")
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('b', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(m.interpreter_info()['libpython'])")
    seen = {}
    for real, exe in _interpreters().items():
        probe = subprocess.run([exe, "-I", "-c", code, str(ROOT / "kvown" / "runtime" / "build.py")],
                               capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:  # an older Python on PATH: not ours to judge
            continue
        ldd = subprocess.run(["ldd", real], capture_output=True, text=True, timeout=30)
        linked = "libpython3" in ldd.stdout
        seen[real] = probe.stdout.strip()
        assert seen[real] == ("shared" if linked else "static"), (real, seen[real])
    assert os.path.realpath(sys.executable) in seen, seen
