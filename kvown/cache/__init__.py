"""KV block pool and layouts: standard K/V, MLA latent and NVFP4 (packed values + scales) as data.

``KVLayout`` says where every byte of a block lives; ``KVPool`` holds the bytes and the FREE / OWNED /
HELD state of every block, with ``total == free + owned + held`` checked after every change.
"""

from kvown.cache.layout import DTYPE_NBYTES, KVLayout, Plane
from kvown.cache.pool import BlockState, KVPool, PoolExhausted, PoolStatistics

__all__ = ["DTYPE_NBYTES", "BlockState", "KVLayout", "KVPool", "Plane", "PoolExhausted", "PoolStatistics"]
