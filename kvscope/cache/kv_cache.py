"""The paged K/V tensors: one preallocated key and value tensor per layer.

Shape `[num_blocks, block_size, num_kv_heads, head_dim]` (a view: the storage is
block-major or head-major, as `attention.block_major_cache` says for the device), and slot
`s` is block `s // block_size`,
offset `s % block_size`. Which block belongs to whom is the `BlockPool`'s business; this class
only holds the memory and copies blocks for copy-on-write.
"""

from __future__ import annotations

import torch

from kvscope.kernels.attention import block_major_cache


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
                storage = torch.zeros(
                    (num_kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device
                )
                return storage.permute(1, 2, 0, 3)
            return torch.zeros(
                (num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
            )

        self.keys = [allocate() for _ in range(num_layers)]
        self.values = [allocate() for _ in range(num_layers)]

    def share_memory(self) -> None:
        """Move the K/V tensors to shared memory (for a model worker process)."""
        for cache in (*self.keys, *self.values):
            cache.share_memory_()

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
