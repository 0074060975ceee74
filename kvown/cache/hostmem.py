"""Host (CPU) memory for KV pools: zero-filled, 2 MiB-aligned, on transparent huge pages where allowed.

Owns: the allocation of kvown's own block memory (``KVPool``, the benchmarks' raw buffers): host memory
as below, GPU memory as ``torch.zeros`` on the device (``device_bytes`` chooses).

Rules:
  1. ``host_bytes(nbytes)`` returns a zero-filled uint8 CPU tensor whose pages are faulted in before it
     returns: no WRITE pays a first-touch fault, and a machine short of memory fails at start, not
     mid-transfer. From ``HUGE_PAGE_NBYTES`` up its first byte is 2 MiB-aligned in its own mapping.
  2. With ``huge_pages=True`` (and at least ``HUGE_PAGE_NBYTES``; a smaller pool would round a whole
     huge page up for a few blocks) the mapping is advised ``MADV_HUGEPAGE`` before its first touch.
     Where the kernel refuses (no THP, not Linux) the memory is the same in base pages;
     ``HostBytes.advised`` says which. Why: a CPU WRITE (UCX cma) and an RDMA registration pin every
     page they touch, so 2 MiB pages pin 512 times fewer (docs/design.md section 14, "Host memory").
  3. The tensor owns its mapping (``torch.frombuffer`` holds the ``mmap``): nothing unmaps it while a
     view of it lives.
"""

from __future__ import annotations

import dataclasses
import mmap

import torch

from kvown.core.errors import ConfigError

HUGE_PAGE_NBYTES = 2 << 20
THP_ENABLED_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"
THP_GRANTING_MODES = ("always", "madvise")  # the kernel modes in which an advised mapping gets huge pages


@dataclasses.dataclass(frozen=True)
class HostBytes:
    tensor: torch.Tensor  # uint8, 1-D, ``nbytes`` long, zero-filled
    advised: bool  # MADV_HUGEPAGE was asked for and the kernel accepted it


def host_bytes(nbytes: int, *, huge_pages: bool = True) -> HostBytes:
    """``nbytes`` of zeroed host memory (rules 1-3). After error: ``ConfigError(field="nbytes")``, nothing
    allocated."""
    if type(nbytes) is not int or nbytes <= 0:
        raise ConfigError("must be a positive int", field="nbytes", value=nbytes)
    if nbytes < HUGE_PAGE_NBYTES:
        return HostBytes(torch.zeros(nbytes, dtype=torch.uint8), False)
    # One huge page more than asked, so the tensor can start on a 2 MiB boundary of the mapping.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_NBYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    offset = -whole.data_ptr() % HUGE_PAGE_NBYTES
    advised = False
    if huge_pages and hasattr(region, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
            advised = True
        except OSError:  # THP compiled out: base pages, same bytes
            pass
    tensor = whole[offset : offset + nbytes]
    tensor.zero_()  # rule 1: fault every page in now (a fresh anonymous mapping is already zero)
    return HostBytes(tensor, advised)


def device_bytes(nbytes: int, device: str | torch.device, *, huge_pages: bool = True) -> HostBytes:
    """``nbytes`` of zeroed memory on ``device``: ``host_bytes`` on the CPU, ``torch.zeros`` on a GPU
    (``advised`` False there: GPU memory has no transparent huge pages)."""
    if torch.device(device).type == "cpu":
        return host_bytes(nbytes, huge_pages=huge_pages)
    return HostBytes(torch.zeros(nbytes, dtype=torch.uint8, device=device), False)


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), or "unknown"."""
    try:
        with open(THP_ENABLED_PATH) as f:
            text = f.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"


def huge_page_nbytes(addr: int) -> int:
    """Bytes of the mapping holding ``addr`` that sit on transparent huge pages (``AnonHugePages`` in
    /proc/self/smaps); 0 where unknown. For diagnostics and tests: it reads the whole smaps file."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:  # a mapping's header line: "start-end perms ..."
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
