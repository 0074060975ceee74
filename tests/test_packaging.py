"""Packaging: kernels/ installs as kvown.kernels, never as a top-level ``kernels`` (Hugging Face's
package has that name), in the wheel and in the editable install; and the GPU carry's wheel slimmer."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("slim_wheel", ROOT / "benchmarks" / "slim_wheel.py")
assert _spec and _spec.loader
slim_wheel = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slim_wheel)

HF_KERNELS = "kernels==0.10.5"  # Hugging Face's package (pure Python; huggingface_hub, packaging, pyyaml)


def clean_env() -> dict[str, str]:
    """This process's environment without what points imports at a checkout or a build (the compiled
    run's PYTHONPATH): a clean venv must import only what was installed into it."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "KVOWN_COMPILE")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvown's wheel, built from a copy of the sources (no build/ or egg-info left in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for folder in ("kvown", "kernels", "buildtools"):
        shutil.copytree(ROOT / folder, src / folder, ignore=skip)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
        env=clean_env(),
    )
    (built,) = (tmp / "dist").glob("kvown-*.whl")
    return built


@pytest.mark.timeout(300)
def test_the_wheel_has_kvown_kernels_and_no_top_level_kernels(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.split("/")[0] not in ("kvown",) and ".dist-info/" not in n]
    for member in (
        "kvown/kernels/__init__.py",
        "kvown/kernels/ops.py",
        "kvown/kernels/errors.py",
        "kvown/kernels/cuda/kv_kernels.cu",
        "kvown/kernels/cuda/kv_math.cuh",
        "kvown/kernels/host/kv_host.cpp",
    ):
        assert member in names, member
    assert any(n.startswith("kvown/kernels/_kv_host") and n.endswith(".so") for n in names)
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["kvown"]


@pytest.mark.timeout(60)
def test_the_editable_install_maps_kvown_kernels_and_installs_no_kernels(tmp_path: Path) -> None:
    """Run from outside the checkout (python -m puts the current directory on sys.path)."""
    probe = (
        "import importlib.util as u, kvown.kernels._kv_host as h; "
        "print(u.find_spec('kernels'), u.find_spec('kvown.kernels').origin, h.__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", str(ROOT / "kernels" / "__init__.py"), "kvown.kernels._kv_host"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kvown_installs_and_imports_beside_hugging_faces_kernels(wheel: Path, tmp_path: Path) -> None:
    """A clean venv with Hugging Face's ``kernels`` (from the registry) and kvown's wheel: both import,
    each from its own files, kvown's host extension and CUDA sources included."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=clean_env())
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, HF_KERNELS], check=True, timeout=300, env=clean_env())
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True, timeout=120, env=clean_env())
    probe = (
        "import kernels, kvown.kernels, kvown.kernels.errors as e, kvown.kernels._kv_host as h, "
        "kvown.kernels.cuda_loader as c; import importlib.metadata as m\n"
        "assert callable(kernels.get_kernel) and m.version('kernels') == kernels.__version__\n"
        "assert issubclass(e.KernelInputError, ValueError) and h.mix32\n"
        "assert 'kv_pattern_fill' in c.kernel_source()\n"
        "print(kernels.__file__); print(kvown.kernels.__file__)"
    )
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=clean_env(),
    )
    assert done.returncode == 0, done.stderr
    hf, ours = done.stdout.split()
    assert hf.endswith("site-packages/kernels/__init__.py") and ours.endswith(
        "site-packages/kvown/kernels/__init__.py"
    )


# ---- benchmarks/slim_wheel.py ---------------------------------------------------------------------


def toy_wheel(tmp: Path) -> Path:
    files = {
        "pkg/__init__.py": b"x = 1\n",
        "pkg/big.so": b"\0" * 4096,
        "extra_ep/__init__.py": b"y = 2\n",
        "extra_ep/huge.so": b"\1" * 8192,
    }
    record = [f"{n},sha256={hashlib.sha256(b).hexdigest()},{len(b)}" for n, b in files.items()]
    path = tmp / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("pkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\n")
        z.writestr(
            "pkg-1.0.dist-info/RECORD",
            "\n".join([*record, "pkg-1.0.dist-info/WHEEL,,", "pkg-1.0.dist-info/RECORD,,"]) + "\n",
        )
    return path


@pytest.mark.timeout(30)
def test_a_slimmed_wheel_drops_the_folder_and_its_record_lines(tmp_path: Path) -> None:
    out = slim_wheel.slim(toy_wheel(tmp_path), ["extra_ep/"], tmp_path / "out")
    z = zipfile.ZipFile(out)
    assert sorted(z.namelist()) == [
        "pkg-1.0.dist-info/RECORD",
        "pkg-1.0.dist-info/WHEEL",
        "pkg/__init__.py",
        "pkg/big.so",
    ]
    record = z.read("pkg-1.0.dist-info/RECORD").decode().splitlines()
    assert [line.split(",")[0] for line in record] == [
        "pkg/__init__.py",
        "pkg/big.so",
        "pkg-1.0.dist-info/WHEEL",
        "pkg-1.0.dist-info/RECORD",
    ]
    assert z.read("pkg/big.so") == b"\0" * 4096 and out.name == "pkg-1.0-py3-none-any.whl"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("drop", ["no_such_folder/", "pkg-1.0.dist-info/"])
def test_the_slimmer_refuses_a_prefix_that_matches_nothing_or_metadata(tmp_path: Path, drop: str) -> None:
    with pytest.raises(ValueError):
        slim_wheel.slim(toy_wheel(tmp_path), [drop], tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_wheel_alone_is_the_runtime_and_doctor_names_the_missing_extras(wheel: Path, tmp_path: Path) -> None:
    """A clean venv with kvown's wheel and its base dependencies only (versions from the lock file): the
    runtime imports, no web stack or plotting library came with it, and ``kvown doctor`` names each extra."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=clean_env())
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    lock = str(ROOT / "requirements.lock")
    subprocess.run([*pip, "-c", lock, str(wheel)], check=True, timeout=1200, env=clean_env())
    probe = ("import importlib.util as u, kvown, kvown.rank, kvown.runtime.stack\n"
             "print([m for m in ('fastapi', 'uvicorn', 'httpx', 'matplotlib', 'tqdm', 'zmq') if u.find_spec(m)])")
    done = subprocess.run(
        [python, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=clean_env()
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    done = subprocess.run([str(venv / "bin" / "kvown"), "doctor", "--json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=clean_env())
    import json

    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    for extra in ("serve", "bench", "vllm"):
        assert checks[extra]["status"] == "ABSENT" and checks[extra]["fix"] == f"pip install 'kvown[{extra}]'"
    assert "fastapi" in checks["serve"]["detail"] and "matplotlib" in checks["bench"]["detail"]
