"""Real-vLLM fixtures: the vLLM venv's python, the offline tiny model, and stacks started once per
session (the single instance, the oracle of every token-exact check) or once per module (P/D pairs).
Every stack is stopped by its fixture, process groups and all (stack.py rule 1)."""

from __future__ import annotations

import pytest
from vllmkit import running

from kvown.apps.serve.vllm.stack import build_model, find_vllm_python
from kvown.core.errors import ConfigError


@pytest.fixture(scope="session")
def vllm_python() -> str:
    try:
        return find_vllm_python()
    except ConfigError as error:
        pytest.skip(f"no vLLM venv: {error} (make vllm-setup builds it)")


@pytest.fixture(scope="session")
def tiny_model(vllm_python, tmp_path_factory) -> str:
    return str(build_model(vllm_python, tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="session")
def single_stack(tiny_model, tmp_path_factory):
    with running(None, tiny_model, tmp_path_factory.mktemp("vllm-single")) as stack:
        yield stack
