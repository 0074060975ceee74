"""``kvown serve prefill|decode|single|router|local|vllm``: the reference disaggregated server's command line.

Owns: argument parsing for the five programs and the ``local`` supervisor loop; ``vllm`` (real vLLM
instances behind kvown's proxy) is handed on to kvown/apps/serve/vllm/cli.py.

    kvown serve local --port 8000            etcd + prefill + decode + router on this machine
    kvown serve local --single --port 8000   the same model and seed in one process, no transfer
    kvown serve prefill --etcd http://127.0.0.1:2379 --name prefill-0
    kvown serve decode  --etcd http://127.0.0.1:2379 --name decode-0
    kvown serve router  --etcd http://127.0.0.1:2379 --port 8000
    kvown serve vllm --connector nixl|nixl-push|kvown [--single] [--model DIR]   real vLLM P/D + proxy

Rules:
  1. Servers launched apart find each other only through etcd (``--etcd``, ``--cluster``).
  2. Every server of one cluster must use the same model options; the KV link refuses a layout
     mismatch at its handshake and the router pairs only servers with the same model digest.
  3. ``local`` serves until SIGINT/SIGTERM or until a child dies (then it exits 1); either way every
     child and etcd are stopped.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

USAGE = "kvown serve {prefill,decode,single,router,local,vllm} [options]"


def _model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (identical on every server of a cluster)")
    g.add_argument("--model-name", default="kvown-tiny")
    g.add_argument("--seed", type=int, default=0, help="weights are drawn from this seed")
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--d-model", type=int, default=64)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=16)
    g.add_argument("--ffn-dim", type=int, default=128)
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--max-prompt-tokens", type=int, default=512)
    s = p.add_argument_group("server")
    s.add_argument("--num-blocks", type=int, default=2048, help="KV blocks this server owns")
    s.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when present)")
    s.add_argument("--threads", type=int, default=1, help="torch threads for the model")
    s.add_argument("--landing-timeout", type=float, default=30.0, help="decode: seconds to wait for the KV")
    s.add_argument(
        "--publish-timeout", type=float, default=30.0, help="prefill: seconds to keep unclaimed KV"
    )
    s.add_argument("--link-pace-ms", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: a slow fabric


def _cluster_options(p: argparse.ArgumentParser, *, etcd_required: bool) -> None:
    p.add_argument("--etcd", required=etcd_required, help="etcd endpoint, e.g. http://127.0.0.1:2379")
    p.add_argument("--cluster", default="default", help="servers of one cluster share this etcd prefix")
    p.add_argument("--lease-ttl", type=int, default=3, help="seconds after which a dead server vanishes")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: any free port)")


def _run_server(role: str, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"kvown serve {role}")
    p.add_argument("--name", default=f"{role}-0", help="unique in the cluster")
    p.add_argument("--link", choices=["kvown", "loopback"], default="kvown",
                   help="how KV moves: kvown (NIXL WRITEs, ownership with proof) or loopback (reference TCP)")
    p.add_argument("--rank", type=int, default=-1, help="this server's kvown rank, unique in the cluster")
    _cluster_options(p, etcd_required=role != "single")
    _model_options(p)
    a = p.parse_args(argv)
    from kvown.apps.serve.server import serve
    from kvown.core.errors import ConfigError

    try:
        config = _server_config(role, a)
    except ConfigError as exc:  # a bad option: named, before a model, a pool or a socket exists
        return _refused(p.prog, exc)
    return serve(config)


def _refused(prog: str, exc: Exception) -> int:
    print(f"{prog}: {exc}", file=sys.stderr)
    return 2


def _server_config(role: str, a: argparse.Namespace) -> Any:
    """The server's ``ServeConfig``; ``ConfigError`` naming the first bad field."""
    from kvown.apps.serve.model import ModelConfig
    from kvown.apps.serve.server import ServeConfig

    model = ModelConfig(
        d_model=a.d_model,
        num_layers=a.layers,
        num_heads=a.heads,
        num_kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        ffn_dim=a.ffn_dim,
        max_model_len=a.max_model_len,
        block_size=a.block_size,
        seed=a.seed,
    )
    return ServeConfig(
        role=role,
        name=a.name,
        model=model,
        model_name=a.model_name,
        host=a.host,
        port=a.port,
        etcd=a.etcd,
        cluster=a.cluster,
        num_blocks=a.num_blocks,
        device=a.device,
        threads=a.threads,
        max_prompt_tokens=a.max_prompt_tokens,
        landing_timeout_s=a.landing_timeout,
        publish_timeout_s=a.publish_timeout,
        lease_ttl_s=a.lease_ttl,
        link_pace_s=a.link_pace_ms / 1000,
        link=a.link,
        kvown_rank=a.rank,
    )


def _run_router(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvown serve router")
    p.add_argument("--name", default="router-0")
    _cluster_options(p, etcd_required=True)
    p.add_argument("--request-timeout", type=float, default=60.0, help="longest silence from an upstream")
    a = p.parse_args(argv)
    from kvown.apps.serve.router import RouterConfig, serve_router
    from kvown.core.errors import ConfigError

    try:
        config = RouterConfig(etcd=a.etcd, name=a.name, cluster=a.cluster, host=a.host, port=a.port,
                              request_timeout_s=a.request_timeout, lease_ttl_s=a.lease_ttl)
    except ConfigError as exc:
        return _refused(p.prog, exc)
    return serve_router(config)


def _run_local(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="kvown serve local",
        description="the whole stack on this machine; extra options go to the servers",
    )
    p.add_argument("--single", action="store_true", help="one process, no etcd, no transfer")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-dir", default=None, help="where the children's logs go (default: a temp dir)")
    a, server_args = p.parse_known_args(argv)
    from kvown.apps.serve.local import LocalStack
    from kvown.apps.serve.protocol import check_port
    from kvown.core.errors import ConfigError

    try:
        check_port(a.port)
    except ConfigError as exc:
        return _refused(p.prog, exc)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = LocalStack(single=a.single, port=a.port, server_args=server_args, log_dir=a.log_dir)
    status = 0
    try:
        stack.start()
        mode = "single process" if a.single else "disaggregated: prefill-0 -> decode-0 via the KV link"
        print(
            f"kvown serve local: {mode}; OpenAI API at {stack.url}/v1 "
            f"(logs in {stack.log_dir}); Ctrl-C stops",
            flush=True,
        )
        while not stop.wait(0.5):
            if stack.dead():
                print(f"kvown serve local: {', '.join(stack.dead())} exited; stopping", file=sys.stderr)
                status = 1
                break
    finally:
        stack.stop()
    return status


def main(argv: list[str]) -> int:
    """Entry of ``kvown serve``. Called: once per process, from the main thread."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or "").split("\n\n")[2], file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    command, rest = argv[0], argv[1:]
    if command in ("prefill", "decode", "single"):
        return _run_server(command, rest)
    if command == "router":
        return _run_router(rest)
    if command == "local":
        return _run_local(rest)
    if command == "vllm":
        from kvown.apps.serve.vllm.cli import main as vllm_main

        return vllm_main(rest)
    print(f"kvown serve: unknown program {command!r}; {USAGE}", file=sys.stderr)
    return 2
