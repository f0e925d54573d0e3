"""The paged K/V tensors: one preallocated key and value tensor per layer.

Shape `[num_blocks, block_size, num_kv_heads, head_dim]` (a view: the storage is
block-major or head-major, as its maker says, asking the kernels that will read it:
`kernels.attention_backend.block_major_cache`), and slot `s` is block `s // block_size`,
offset `s % block_size`. Which block belongs to whom is the `BlockPool`'s business; this class
only holds the memory and copies blocks for copy-on-write.

It also tells Linux how the memory is used: huge pages where they can be had
(`advise_huge_pages`). Shared memory gets none while Linux's shmem setting is `never`, its
default, so the model worker takes the cache its engine shared with it over as memory of
its own at its hand-over (`taken_over`), and gives the shared pages back.
"""

from __future__ import annotations

import ctypes
import sys

import torch

#: Linux's `madvise` advice: transparent huge pages; free a shared range's memory.
_MADV_HUGEPAGE = 14
_MADV_REMOVE = 9
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
        block_major: bool,
    ) -> None:
        self.block_size = block_size
        # Head-major storage ([kv_heads, blocks, slots, dim]) is seen through a
        # [blocks, slots, kv_heads, dim] view: a batch's blocks then gather into one
        # contiguous tensor per head, as the reference decode kernel wants.
        head_major = not block_major

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

    @classmethod
    def _of(cls, block_size: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> KVCache:
        cache = cls.__new__(cls)
        cache.block_size, cache.keys, cache.values = block_size, keys, values
        return cache

    def share_memory(self) -> None:
        """Move the K/V tensors to shared memory (for a model worker process)."""
        for cache in (*self.keys, *self.values):
            cache.share_memory_()

    def taken_over(self, *, keep_contents: bool) -> KVCache:
        """(the model worker, at its hand-over) This shared cache as memory of this
        process's own, on huge pages where Linux gives them, mapped in before the first
        step. Each tensor in turn is allocated in the same layout, filled (copied where
        `keep_contents`, the engine having run steps on it; else zeros), and its shared
        pages given back (`MADV_REMOVE`: the engine's view then reads zeros), so the two
        copies never hold more than one layer's tensor twice.

        The decode reads its sequences' blocks wherever the pool put them, a TLB miss a
        block on shared memory's 4 KiB pages: on the AVX2 machine, the compiled decode
        kernel for 32 rows at context 384, 8 layers, took 13.7-18.0 ms a step on memory
        of its own against 15.9-19.0 on shared memory (medians ~14.3 against ~18.5;
        docs/benchmarks/README.md, "Measured settings": the worker's K/V cache its own
        memory). Where `MADV_REMOVE` is refused, both copies stay."""

        def own(shared: torch.Tensor) -> torch.Tensor:
            tensor = torch.empty_strided(
                shared.shape, shared.stride(), dtype=shared.dtype, device=shared.device
            )
            advise_huge_pages(tensor)  # before the first touch, which the fill is
            if keep_contents:
                tensor.copy_(shared)
            else:
                tensor.zero_()
            _madvise(shared, _MADV_REMOVE, _PAGE)
            return tensor

        return KVCache._of(
            self.block_size, [own(t) for t in self.keys], [own(t) for t in self.values]
        )

    @property
    def block_major(self) -> bool:
        """Whether the storage is block-major: one slot's heads lie side by side."""
        keys = self.keys[0]
        return keys.stride(2) == keys.shape[3]

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
    (docs/benchmarks/README.md, "Measured settings": huge pages under the K/V cache).
    Only memory of this process's own gets them (the thread worker's cache, an engine
    in-process); shared memory (the process worker's) takes the kernel's shmem setting,
    off by default. Nothing happens where the call or the advice is not there."""
    _madvise(tensor, _MADV_HUGEPAGE, _HUGE_PAGE)


def _madvise(tensor: torch.Tensor, advice: int, page: int) -> None:
    """`madvise` over the `page`-sized pages wholly inside a CPU tensor's storage;
    errors are ignored."""
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first, last = -(-start // page) * page, end // page * page
    if last <= first:
        return
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return
    madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), advice)
