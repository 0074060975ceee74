"""Host memory for CPU pools: zeroed, faulted in, and on transparent huge pages where the kernel allows."""

from __future__ import annotations

import gc

import pytest

from kvown.cache import KVLayout, KVPool
from kvown.cache.hostmem import HUGE_PAGE_NBYTES, THP_GRANTING_MODES, host_bytes, huge_page_nbytes, thp_mode
from kvown.core.errors import ConfigError
from kvown.runtime.config import TransferConfig

# "always" backs every large anonymous mapping, "madvise" only advised ones: both must show huge pages
THP_ON = thp_mode() in THP_GRANTING_MODES


@pytest.mark.timeout(20)
def test_large_host_bytes_are_zeroed_aligned_and_on_huge_pages() -> None:
    h = host_bytes(3 * HUGE_PAGE_NBYTES + 4096)
    assert h.tensor.numel() == 3 * HUGE_PAGE_NBYTES + 4096 and not bool(h.tensor.any())
    assert h.tensor.data_ptr() % HUGE_PAGE_NBYTES == 0
    assert h.advised
    if THP_ON:  # a version that forgets the madvise stays in 4 KiB pages on a "madvise" kernel
        assert huge_page_nbytes(h.tensor.data_ptr()) >= HUGE_PAGE_NBYTES


@pytest.mark.timeout(20)
def test_huge_pages_false_stays_in_base_pages() -> None:
    h = host_bytes(2 * HUGE_PAGE_NBYTES, huge_pages=False)
    assert not h.advised and not bool(h.tensor.any())
    if thp_mode() == "madvise":
        assert huge_page_nbytes(h.tensor.data_ptr()) == 0


@pytest.mark.timeout(10)
def test_small_host_bytes_do_not_round_up_to_a_huge_page() -> None:
    h = host_bytes(64 * 1024)
    assert not h.advised and h.tensor.numel() == 64 * 1024 and not bool(h.tensor.any())


@pytest.mark.timeout(10)
@pytest.mark.parametrize("nbytes", [0, -1, 1.5, True, "4096"])
def test_bad_size_is_a_config_error_naming_nbytes(nbytes: object) -> None:
    with pytest.raises(ConfigError) as e:
        host_bytes(nbytes)  # type: ignore[arg-type]
    assert e.value.field == "nbytes"


@pytest.mark.timeout(20)
def test_a_view_keeps_the_mapping_alive() -> None:
    view = host_bytes(HUGE_PAGE_NBYTES + 8).tensor[HUGE_PAGE_NBYTES:]
    gc.collect()  # the HostBytes and the full tensor are gone; the mapping must not be
    view.fill_(9)
    assert int(view.sum()) == 9 * 8


@pytest.mark.timeout(20)
def test_cpu_pool_asks_for_huge_pages_unless_told_not_to() -> None:
    layout = KVLayout.standard(num_layers=4, num_blocks=64, tokens_per_block=16, num_kv_heads=2, head_dim=128)
    pool = KVPool(layout)
    assert pool.huge_pages_advised and pool.base_addr % HUGE_PAGE_NBYTES == 0
    if THP_ON:
        assert huge_page_nbytes(pool.base_addr) >= HUGE_PAGE_NBYTES
    plain = KVPool(layout, huge_pages=False)
    assert not plain.huge_pages_advised and not bool(plain.tensor.any())


@pytest.mark.timeout(10)
def test_transfer_config_huge_pages_must_be_a_bool() -> None:
    assert TransferConfig().huge_pages is True
    with pytest.raises(ConfigError) as e:
        TransferConfig(huge_pages="yes")  # type: ignore[arg-type]
    assert e.value.field == "huge_pages"
