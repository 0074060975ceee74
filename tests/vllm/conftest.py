"""Real-vLLM fixtures: the vLLM venv's python, the offline tiny model, and stacks started once per
session (the single instance, the oracle of every token-exact check) or once per module (P/D pairs).
Every stack is stopped by its fixture, process groups and all (stack.py rule 1)."""

from __future__ import annotations

import contextlib

import pytest

from kvown.apps.serve.vllm.stack import StackOptions, VllmStack, build_model, find_vllm_python
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


@contextlib.contextmanager
def running(connector: str | None, model: str, run_dir, **kw):
    with VllmStack(StackOptions(connector=connector, model=model, run_dir=str(run_dir), **kw)) as stack:
        yield stack


@pytest.fixture(scope="session")
def single_stack(tiny_model, tmp_path_factory):
    with running(None, tiny_model, tmp_path_factory.mktemp("vllm-single")) as stack:
        yield stack
