"""A pool's VRAM is registered with NIXL under the id of the GPU that holds it, not the one asked for.

``KVPool(layout, device="cuda")`` allocates on the *current* device; on a host with several GPUs a rank
bound to GPU 3 asks for "cuda" and gets cuda:3. NIXL's UCX backend refuses VRAM registered under
another device id, so every rank but GPU 0's failed to start. Checked on CPU: the pool's bytes are
presented as a tensor on cuda:3, and the fake NIXL library on that "host" refuses a mismatched id, as
UCX does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvown.adapters.transport import KVTransport, Role
from kvown.cache import KVLayout, KVPool
from kvown.core.errors import AdapterError
from kvown.testing.fake_nixl import FakeFabric, FakeNixlEndpoint, _FakeAgent

pytestmark = pytest.mark.timeout(30)
GPU = 3


class _OnGpu:
    """A CPU tensor's bytes seen as a tensor on cuda:``index`` (what the pool holds after set_device)."""

    def __init__(self, tensor: torch.Tensor, index: int) -> None:
        self._tensor = tensor
        self.device = torch.device("cuda", index)
        self.is_cuda = True

    def data_ptr(self) -> int:
        return self._tensor.data_ptr()


class _MultiGpuAgent(_FakeAgent):
    """The fake library on a host whose VRAM is on GPU ``GPU``: VRAM under another id is refused."""

    def __init__(self, name: str, fabric: FakeFabric) -> None:
        super().__init__(name, fabric)
        self.vram: list[tuple[int, int]] = []  # (addr, device id) of each VRAM registration

    def register_memory(self, reg_list: list[tuple[int, int, int, str]], mem: str) -> int:
        (addr, nbytes, device_id, _), = reg_list
        if mem == "VRAM":
            if device_id != GPU:
                raise RuntimeError(f"NIXL_ERR_BACKEND: ucp_mem_map: memory on cuda:{GPU}, given {device_id}")
            self.vram.append((addr, device_id))
        return super().register_memory([(addr, nbytes, device_id, "")], "DRAM")  # bytes are host bytes here


def gpu_pool(scale_layout: str) -> KVPool:
    """A pool asked for as "cuda" whose memory is on cuda:GPU (its scale pool too)."""
    layout = KVLayout.nvfp4(num_layers=2, num_blocks=4, tokens_per_block=16, num_kv_heads=2, head_dim=32,
                            scale_layout=scale_layout)
    pool = KVPool(layout)
    for p in (pool, pool.scales):
        if p is not None:
            p.device = torch.device("cuda")
            p.tensor = _OnGpu(p.tensor, GPU)  # type: ignore[assignment]
    return pool


def transport(space: Any, fabric: FakeFabric | None = None) -> KVTransport:
    endpoint = FakeNixlEndpoint("r0", fabric=fabric or FakeFabric(), agent_type=_MultiGpuAgent)
    return KVTransport(endpoint, 0, space, torch.zeros(64, dtype=torch.uint8),
                       aux_slot_nbytes=16, roles=frozenset({Role.RECEIVER}), geometry_digest="g")


@pytest.mark.parametrize("scale_layout", ["inline", "separate"])
def test_vram_is_registered_under_the_gpu_that_holds_it(scale_layout: str) -> None:
    pool = gpu_pool(scale_layout)
    space = pool.space()
    assert (space.mem, space.device_id) == ("VRAM", GPU)
    fabric = FakeFabric()
    transport(space, fabric)
    agent = fabric.agent("r0")
    assert [d for _, d in agent.vram] == [GPU] * len(space.regions)  # every region, scales included
    assert [a for a, _ in agent.vram] == [r.base_addr for r in space.regions]


def test_mutant_registering_under_the_requested_index_is_refused() -> None:
    """The old ``self.device.index or 0``: "cuda" has no index, so GPU 0 - which UCX refuses here."""
    pool = gpu_pool("inline")
    requested = dataclasses.replace(pool.space(), device_id=pool.device.index or 0)
    with pytest.raises(AdapterError) as raised:
        transport(requested)
    assert raised.value.fields["op"] == "register_memory"


def test_a_cpu_pool_stays_dram_on_device_zero() -> None:
    space = KVPool(KVLayout.standard(num_layers=1, num_blocks=2, tokens_per_block=2, num_kv_heads=1,
                                     head_dim=8)).space()
    assert (space.mem, space.device_id) == ("DRAM", 0)
