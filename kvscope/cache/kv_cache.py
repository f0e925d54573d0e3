"""The paged K/V tensors: one preallocated key and value tensor per layer.

Shape `[num_blocks, block_size, num_kv_heads, head_dim]` (a view: the storage is
block-major or head-major, as `attention.block_major_cache` says for the device), and slot
`s` is block `s // block_size`,
offset `s % block_size`. Which block belongs to whom is the `BlockPool`'s business; this class
only holds the memory and copies blocks for copy-on-write.

It also tells Linux how the memory is used: huge pages where they can be had (its own
memory; `advise_huge_pages`), and, in the model worker, every page of the shared cache
mapped in before the first step (`map_in`).
"""

from __future__ import annotations

import ctypes
import sys

import torch

from kvscope.kernels.attention import block_major_cache

#: Linux's `madvise` advice: transparent huge pages; map the pages in, writable.
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
#: Page sizes on x86-64: small, and transparent huge.
_PAGE = 4096
_HUGE_PAGE = 2 << 20


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        # Head-major storage ([kv_heads, blocks, slots, dim]) is seen through a
        # [blocks, slots, kv_heads, dim] view: a batch's blocks then gather into one
        # contiguous tensor per head, as the reference decode kernel wants.
        head_major = not block_major_cache(device)

        def allocate() -> torch.Tensor:
            if head_major:
                shape = (num_kv_heads, num_blocks, block_size, head_dim)
            else:
                shape = (num_blocks, block_size, num_kv_heads, head_dim)
            storage = torch.empty(shape, dtype=dtype, device=device)
            advise_huge_pages(storage)  # before the first touch, which the zeros are
            storage.zero_()
            return storage.permute(1, 2, 0, 3) if head_major else storage

        self.keys = [allocate() for _ in range(num_layers)]
        self.values = [allocate() for _ in range(num_layers)]

    def share_memory(self) -> None:
        """Move the K/V tensors to shared memory (for a model worker process)."""
        for cache in (*self.keys, *self.values):
            cache.share_memory_()

    def map_in(self) -> None:
        """Map every page of the K/V tensors into this process now (the model worker, at
        its start, for the cache the engine shared with it), so that no step pays the
        page faults of its first touch: 131,072 for the reference model's 512 MiB, ~50,000
        of them in a run of 64 requests of 384 tokens, most during the first prefills
        (`madvise(MADV_POPULATE_WRITE)`, 37 ms for the whole cache on the 2-core machine).
        Nothing happens where Linux (before 5.14) or the platform lacks the call."""
        for cache in (*self.keys, *self.values):
            _madvise(cache, _MADV_POPULATE_WRITE, whole_pages=False)

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block in every layer."""
        if not copies:
            return
        device = self.keys[0].device
        src = torch.tensor([s for s, _ in copies], device=device)
        dst = torch.tensor([d for _, d in copies], device=device)
        for cache in (*self.keys, *self.values):
            cache[dst] = cache[src]


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask Linux for transparent huge pages under a CPU tensor not yet touched. A decode
    step reads its sequences' blocks wherever the pool put them, a TLB miss a block on
    4 KiB pages: the decode kernel alone, 32 rows over blocks in random order (measured
    on a head-major cache), took 0.80 ms a layer on huge pages against 0.90-1.10
    (docs/benchmarks/README.md, session 18).
    Only memory of this process's own gets them (the thread worker's cache, an engine
    in-process); shared memory (the process worker's) takes the kernel's shmem setting,
    off by default. Nothing happens where the call or the advice is not there."""
    _madvise(tensor, _MADV_HUGEPAGE, whole_pages=True)


def _madvise(tensor: torch.Tensor, advice: int, *, whole_pages: bool) -> None:
    """`madvise` over a CPU tensor's storage: only the huge pages wholly inside it
    (`whole_pages`), or every small page it touches; errors are ignored."""
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    if whole_pages:
        first, last = -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
    else:
        first, last = start // _PAGE * _PAGE, end
    if last <= first:
        return
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return
    madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), advice)
