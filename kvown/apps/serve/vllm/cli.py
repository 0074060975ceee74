"""``kvown serve vllm``: real vLLM prefill + decode behind kvown's OpenAI proxy, on this machine.

    kvown serve vllm --port 8000                       NixlConnector (pull) P/D pair + proxy
    kvown serve vllm --connector nixl-push             NixlPushConnector
    kvown serve vllm --connector kvown                 kvown's connector (etcd started too)
    kvown serve vllm --single                          one plain vLLM instance behind the same proxy
    kvown serve vllm --model DIR -- --max-num-seqs 8   any local HF model dir; after --: vLLM options

Rules: serves until SIGINT/SIGTERM or until a process dies (then exits 1); either way every process
group is stopped (stack.py rule 1). The vLLM processes run from the vLLM venv (``--vllm-python``,
$KVOWN_VLLM_PYTHON, or this checkout's .venv-vllm); NixlConnector figures come with kvown's baseline
fix (its UCX progress thread off, kvown/integrations/vllm/plugin.py).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from kvown.apps.serve.vllm.connectors import CONNECTORS
from kvown.core.errors import KvownError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvown serve vllm", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--connector", choices=sorted(CONNECTORS), default="kvown")
    p.add_argument("--single", action="store_true", help="one plain vLLM instance, no transfer")
    p.add_argument("--model", default=None, help="local HF model directory (default: build the tiny model)")
    p.add_argument("--model-name", default="tiny", help="the name clients send as 'model'")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--run-dir", default=None, help="logs and the built model (default: a temp dir)")
    p.add_argument("--vllm-python", default=None, help="python of the vLLM venv")
    p.add_argument("--kv-cache-bytes", type=int, default=128 << 20, help="--kv-cache-memory-bytes per instance")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (vLLM's CPU default: 128)")
    p.add_argument("--omp-bind", default="nobind,nobind",
                   help="VLLM_CPU_OMP_THREADS_BIND for prefill,decode (e.g. 0,1); pinning hung once on 2 cores")
    p.add_argument("--start-timeout", type=float, default=360.0)
    return p


def options_from(a: argparse.Namespace, vllm_args: list[str]):  # -> StackOptions
    from kvown.apps.serve.vllm.stack import StackOptions
    from kvown.core.errors import ConfigError

    bind = tuple(a.omp_bind.split(","))
    if len(bind) != 2:
        raise ConfigError("--omp-bind takes PREFILL,DECODE", field="omp_bind")
    return StackOptions(connector=None if a.single else a.connector, model=a.model, model_name=a.model_name,
                        dtype=a.dtype, port=a.port, run_dir=a.run_dir, vllm_python=a.vllm_python,
                        kv_cache_memory_bytes=a.kv_cache_bytes, max_model_len=a.max_model_len,
                        block_size=a.block_size, omp_bind=(bind[0], bind[1]),
                        start_timeout_s=a.start_timeout, vllm_args=vllm_args)


def main(argv: list[str]) -> int:
    """Entry of ``kvown serve vllm``. Called: once per process, from the main thread."""
    own, vllm_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    a = build_parser().parse_args(own)
    from kvown.apps.serve.vllm.stack import VllmStack

    try:
        stack = VllmStack(options_from(a, vllm_args))
    except KvownError as error:  # a bad option, named: nothing was started, no handler installed
        print(f"kvown serve vllm: {error}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    status = 0
    try:
        print(f"kvown serve vllm: starting ({'single' if a.single else a.connector}); logs in {stack.run_dir}",
              flush=True)
        stack.start()
        print(f"kvown serve vllm: OpenAI API at {stack.url}/v1; Ctrl-C stops", flush=True)
        while not stop.wait(0.5):
            if stack.dead():
                print(f"kvown serve vllm: {', '.join(stack.dead())} exited; stopping", file=sys.stderr)
                status = 1
                break
    except KvownError as error:
        print(f"kvown serve vllm: {error}", file=sys.stderr)
        status = 1
    finally:
        stack.stop()
    return status
