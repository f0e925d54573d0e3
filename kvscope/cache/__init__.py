"""The paged KV cache: block ownership (`BlockPool`) and the K/V tensors (`KVCache`)."""

from .block_pool import BlockPool, PoolStats
from .kv_cache import KVCache

__all__ = ["BlockPool", "KVCache", "PoolStats"]
