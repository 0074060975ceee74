"""The pieces around vLLM, each fast: the offline model (deterministic, loads in transformers), the
baseline-fix plugin (as vLLM loads it), finding the vLLM python, and the stack's stop (no process of
an instance's group survives). Safety checks come with their mutants."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from kvown.apps.serve.vllm import stack as st
from kvown.apps.serve.vllm.connectors import Instance
from kvown.apps.serve.vllm.model import TinyConfig
from kvown.core.errors import ConfigError


def _run(python: str, code: str, env: dict[str, str] | None = None) -> str:
    r = subprocess.run([python, "-c", code], env=st.child_env(env or {}), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


# ---- the model -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value"), [("hidden_size", 0), ("vocab_size", 100), ("seed", -1),
                                              ("num_key_value_heads", 3)])
def test_bad_model_config_names_the_field(field, value):
    with pytest.raises(ConfigError) as e:
        TinyConfig(**{field: value}).check()
    assert e.value.field == field


def build_digest(vllm_python: str, out, patch: str = "") -> str:
    code = f"import kvown.apps.serve.vllm.model as m\n{patch}\nm.build({str(out)!r}); print(m.digest({str(out)!r}))"
    return _run(vllm_python, code)


@pytest.mark.vllm
def test_two_builds_are_byte_identical(vllm_python, tmp_path):
    assert build_digest(vllm_python, tmp_path / "a") == build_digest(vllm_python, tmp_path / "b")


@pytest.mark.vllm
def test_determinism_check_catches_an_unseeded_corpus(vllm_python, tmp_path):
    # mutant: the training text drawn from an unseeded generator (a different tokenizer each build)
    patch = "import random; real = m.corpus; m.corpus = lambda seed, lines=4000: real(random.randrange(1 << 30), lines)"
    assert build_digest(vllm_python, tmp_path / "a", patch) != build_digest(vllm_python, tmp_path / "b", patch)


@pytest.mark.vllm
def test_model_loads_in_transformers_with_a_chat_template(vllm_python, tiny_model):
    code = f"""
import json, torch
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
d = {tiny_model!r}
cfg = AutoConfig.from_pretrained(d); tok = AutoTokenizer.from_pretrained(d)
m = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
chat = tok.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=False, add_generation_prompt=True)
ids = tok("the river and the mountain")["input_ids"]
print(json.dumps([type(tok).__name__, len(tok), cfg.head_dim, chat, tok.decode(ids), len(ids),
                  sum(p.numel() for p in m.parameters())]))
"""
    import json

    name, vocab, head_dim, chat, text, n_ids, n_params = json.loads(_run(vllm_python, code).splitlines()[-1])
    assert name in ("PreTrainedTokenizerFast", "TokenizersBackend")  # transformers 5 renamed the class
    assert vocab == 2048 and head_dim == 64
    assert chat == "<|user|>\nhi\n<|assistant|>\n" and text == "the river and the mountain"
    assert n_ids < len(text) / 2  # BPE merged the words: not a byte tokenizer
    assert n_params == 2 * 2048 * 256 + 2 * (2 * 256 + 256 * 256 * 2 + 128 * 256 * 2 + 3 * 512 * 256) + 256


# ---- the baseline-fix plugin -------------------------------------------------------------------------

PLUGIN_PROBE = """
{patch}
from vllm.plugins import load_general_plugins
load_general_plugins()
import importlib
bw = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
print(bw.nixl_agent_config(num_threads=1, capture_telemetry=True).enable_pthread)
"""


def progress_thread(vllm_python: str, fix: bool, patch: str = "") -> bool:
    env = {st.connector("nixl").instance_env().popitem()[0]: "1"} if fix else {}
    out = _run(vllm_python, PLUGIN_PROBE.format(patch=patch), env)
    return out.splitlines()[-1] == "True"


@pytest.mark.vllm
def test_plugin_turns_the_progress_thread_off_only_when_asked(vllm_python):
    assert progress_thread(vllm_python, fix=True) is False
    assert progress_thread(vllm_python, fix=False) is True  # vLLM's own default, untouched


@pytest.mark.vllm
def test_plugin_check_catches_a_plugin_that_keeps_the_thread(vllm_python):
    patch = "import kvown.integrations.vllm.plugin as p; p.no_progress_thread = lambda real: real"  # mutant
    assert progress_thread(vllm_python, fix=True, patch=patch) is True


# ---- finding vLLM, stopping a stack ---------------------------------------------------------------

def test_an_explicit_vllm_python_that_is_missing_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as e:
        st.find_vllm_python(str(tmp_path / "nope"))
    assert e.value.field == "vllm_python"


STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
print("up", flush=True)
time.sleep(120)
"""


def group_gone_after_stop(tmp_path) -> bool:
    """An "instance" whose leader and child ignore SIGTERM (an engine stuck in a kernel): stop must
    still leave nothing of its process group."""
    p = st.VllmProcess(Instance("stub-0", "single", 0, 0), [sys.executable, "-c", STUBBORN],
                       st.child_env({}), tmp_path / "stub.log")
    try:
        deadline = time.monotonic() + 20
        while "up" not in p.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the child has started
        p.stop(grace_s=1.0)
        return not st.group_members(p.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.vllm
def test_stop_removes_the_stacks_tmp_dir(vllm_python, tmp_path):
    stack = st.VllmStack(st.StackOptions(run_dir=str(tmp_path / "run"), vllm_python=vllm_python))
    tmp_dir = stack.tmp_dir
    (tmp_dir / "left-by-an-engine").touch()
    assert tmp_dir.is_dir() and len(str(tmp_dir)) < 64  # room for vLLM's uuid name in a socket path
    stack.stop()
    assert not tmp_dir.exists()


def test_stop_leaves_no_process_of_the_group(tmp_path):
    assert group_gone_after_stop(tmp_path)


def test_stop_check_catches_a_stop_that_signals_the_leader_only(tmp_path, monkeypatch):
    monkeypatch.setattr(st.VllmProcess, "signal", lambda self, sig: os.kill(self.proc.pid, sig))  # mutant
    assert not group_gone_after_stop(tmp_path)
