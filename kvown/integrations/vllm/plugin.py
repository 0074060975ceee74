"""kvown's ``vllm.general_plugins`` entry point: the NixlConnector baseline fix, for comparisons only.

vLLM loads every ``vllm.general_plugins`` entry point in its API server, engine-core and worker
processes (``vllm.plugins.load_general_plugins``). This one does nothing unless ``BASELINE_FIX_ENV``
is ``1``, which the harness (``kvown serve vllm``, the vLLM tests and ``kvown bench vllm``) sets for
vLLM's own NIXL connectors. Then, in that process:

  1. NIXL agents start with ``enable_prog_thread=False``: NIXL's UCX progress thread busy-polls one core
     per agent and vLLM builds ``nixl_agent_config`` with no knob for it; on a 2-core machine two
     instances' threads starve the model (requests took 41-179 s and the 30 s lease expired on each).
     kvown's own agents run with the thread off already, so this puts the baseline on equal terms.
  2. ``torch.cpu._init_amx()``: asks the kernel for AMX tile permission. A decode instance never
     prefills, so nothing else asks, and bf16 attention then dies with SIGILL in the AMX kernel.

Rules: idempotent (vLLM may call it more than once per process); imports vLLM and torch only inside
``register``; every figure measured with it says so (docs/benchmarks.md, the bench JSON).
"""

from __future__ import annotations

import os
import sys
from typing import Any

BASELINE_FIX_ENV = "KVOWN_VLLM_BASELINE_FIX"
_applied = False


def no_progress_thread(real: Any) -> Any:
    """A ``nixl_agent_config`` factory that always turns the progress thread off."""

    def config(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        return real(*args, **kwargs)

    config.kvown_wrapped = real  # type: ignore[attr-defined]
    return config


def register() -> None:
    """The entry point (``kvown = kvown.integrations.vllm.plugin:register``)."""
    global _applied
    if _applied or os.environ.get(BASELINE_FIX_ENV) != "1":
        return
    from vllm.distributed import nixl_utils

    real = nixl_utils._load_nixl_attr("nixl_agent_config")  # imports NIXL the way vLLM does
    if real is not None and not hasattr(real, "kvown_wrapped"):
        # a module global wins over nixl_utils.__getattr__, so base_worker's import sees the wrapper
        nixl_utils.nixl_agent_config = no_progress_thread(real)
    import torch

    amx = bool(torch.cpu._init_amx()) if hasattr(torch.cpu, "_init_amx") else False
    _applied = True
    print(f"kvown vllm plugin (pid {os.getpid()}): NIXL progress thread off; AMX tiles "
          f"{'granted' if amx else 'not available'}", file=sys.stderr, flush=True)
