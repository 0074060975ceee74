"""``kvown doctor`` run in-process: the lines, the JSON, and the exit status on a broken part."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from kvown import cli
from kvown.apps import doctor
from kvown.apps.doctor import CheckResult, CheckStatus

EXPECTED_NAMES = ["python", "torch", "nixl", "mpi", "mpirun", "cupy", "nvrtc", "hostext", "build", "hugepages",
                  "gpu", "serve", "bench", "vllm"]


@pytest.mark.timeout(120)
def test_text_report_has_one_line_per_part_and_this_machine_is_ready(capsys: pytest.CaptureFixture[str]) -> None:
    status = doctor.main([])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[:-1]] == EXPECTED_NAMES
    for line in lines[:-1]:
        assert line.split()[0] in {"OK", "PROBLEM", "ABSENT"}
    # This machine's venv has every required part (the suite itself depends on them).
    required = [line for line in lines[:-1] if line.split()[1] in EXPECTED_NAMES[:5]]
    assert all(line.startswith("OK") for line in required), required
    assert any("UCX agent created" in line for line in lines)
    assert any("thread level multiple" in line for line in lines)
    assert lines[-1] == "kvown doctor: ready"
    assert status == 0


@pytest.mark.timeout(120)
def test_json_report_matches_the_checks(capsys: pytest.CaptureFixture[str]) -> None:
    status = doctor.main(["--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and status == 0
    assert [check["name"] for check in report["checks"]] == EXPECTED_NAMES
    by_name = {check["name"]: check for check in report["checks"]}
    assert by_name["python"]["status"] == "OK" and by_name["python"]["required"] is True
    assert by_name["cupy"]["required"] is False
    assert set(by_name["gpu"]) == {"name", "status", "required", "detail", "fix"}


@pytest.mark.timeout(60)
def test_a_raising_required_probe_is_a_problem_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken_nixl() -> CheckResult:
        raise ImportError("libucx.so not found")

    fast = [(name, required, probe) for name, required, probe in doctor.CHECKS if name in {"python", "cupy"}]
    monkeypatch.setattr(doctor, "CHECKS", [*fast, ("nixl", True, broken_nixl)])
    assert doctor.main(["--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    nixl = report["checks"][-1]
    assert report["ok"] is False
    assert nixl["status"] == "PROBLEM" and "libucx.so not found" in nixl["detail"]
    assert nixl["fix"].startswith("pip install nixl")


@pytest.mark.timeout(60)
def test_a_raising_optional_probe_is_absent_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_gpu() -> CheckResult:
        raise RuntimeError("driver too old")

    monkeypatch.setattr(doctor, "CHECKS", [("python", True, doctor.check_python), ("gpu", False, broken_gpu)])
    results = doctor.run_checks()
    assert results[1].status is CheckStatus.ABSENT and "driver too old" in results[1].detail
    assert doctor.main([]) == 0


@pytest.mark.timeout(60)
def test_low_mpi_thread_level_is_reported_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPI4PY_RC_THREAD_LEVEL", "single")
    result = doctor.check_mpi()
    assert result.status is CheckStatus.PROBLEM
    assert "thread level single" in result.detail
    assert "MPI4PY_RC_THREAD_LEVEL=multiple" in result.fix


@pytest.mark.timeout(120)
def test_cli_dispatches_doctor_with_its_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dist", ["cupy-cuda12x", "cupy-cuda13x"])
def test_cupy_line_names_the_installed_build(monkeypatch: pytest.MonkeyPatch, dist: str) -> None:
    from kvown.kernels import cuda_loader

    monkeypatch.setattr(cuda_loader, "installed_cupy", lambda: (dist, "14.2.0"))
    result = doctor.check_cupy()
    assert result.status is CheckStatus.OK and result.detail == f"{dist} 14.2.0" and not result.required
    monkeypatch.setattr(cuda_loader, "installed_cupy", lambda: None)
    assert doctor.check_cupy().status is CheckStatus.ABSENT


@pytest.mark.timeout(60)
def test_nvrtc_and_host_extension_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvown.kernels import nvrtc

    result = doctor.check_nvrtc()
    assert result.status is CheckStatus.OK and "compiles kvown's kernels" in result.detail  # pinned wheel
    assert doctor.check_host_extension().status is CheckStatus.OK  # built by `make setup`
    monkeypatch.setattr(nvrtc, "find_nvrtc", lambda: None)
    assert doctor.check_nvrtc().status is CheckStatus.ABSENT


@pytest.mark.timeout(30)
def test_a_missing_extra_is_named_with_what_it_is_for(monkeypatch: pytest.MonkeyPatch) -> None:
    real = doctor.importlib.util.find_spec
    monkeypatch.setattr(doctor.importlib.util, "find_spec", lambda m: None if m == "fastapi" else real(m))
    result = doctor.check_extra("serve")
    assert result.status is doctor.CheckStatus.ABSENT and not result.required
    assert "fastapi" in result.detail and "kvown serve" in result.detail and result.fix == "pip install 'kvown[serve]'"
    assert doctor.check_extra("bench").status is doctor.CheckStatus.OK  # this venv has every extra (the lock file)


@pytest.mark.timeout(60)
def test_build_line_says_which_build_this_process_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvown

    line = doctor.check_build()
    assert line.status is CheckStatus.OK and line.detail.startswith(kvown.build_info()["build"])
    half = {"build": "mixed", "compiler": "mypyc", "compiled": ["kvown.core.ids"], "interpreted": ["kvown.core.fence"]}
    monkeypatch.setattr(kvown, "build_info", lambda: half)
    broken = doctor.check_build()
    assert broken.status is CheckStatus.PROBLEM and "kvown.core.fence" in broken.detail and broken.fix


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("mode", "status"), [("madvise", "OK"), ("always", "OK"), ("never", "PROBLEM"),
                                              ("unknown", "PROBLEM")])
def test_huge_pages_line_reads_the_kernels_mode(monkeypatch: pytest.MonkeyPatch, mode: str,
                                                status: str) -> None:
    import kvown.cache.hostmem as hostmem

    monkeypatch.setattr(hostmem, "thp_mode", lambda: mode)
    result = doctor.check_huge_pages()
    assert result.status.name == status and mode in result.detail and not result.required
    assert (result.fix != "") == (status == "PROBLEM")


def test_mpirun_line_names_stale_session_directories(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert doctor.check_mpirun().fix == ""  # nothing stale in an empty temp dir
    (tmp_path / f"ompi.{os.getpid()}").mkdir()  # a pid that runs no launcher: the reuse itself
    result = doctor.check_mpirun()
    assert result.status is CheckStatus.OK and result.required  # kvown's own launches are immune
    assert f"1 stale Open MPI session directory ({tmp_path}/ompi.{os.getpid()})" in result.detail
    assert "listener thread failed to start" in result.fix
