"""Suite-wide settings: keep NIXL quiet and keep fail-stop flight recorders out of the checkout."""

import pytest


@pytest.fixture(autouse=True)
def _kvown_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVOWN_FLIGHT_DIR", str(tmp_path))
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
