"""The block pool: ownership of paged-KV block ids by reference count.

The pool owns `num_blocks` block ids and nothing else (the K/V tensors live in
`kv_cache.KVCache`). Every block is in exactly one of three states:

* **free**: reference count 0, no content worth keeping; on the free list;
* **in use**: reference count > 0 (held by live sequences, and pinned by the running
  step while a forward reads and writes it);
* **cached**: reference count 0 but full and hashed, kept in an LRU prefix cache so a
  later prompt with the same prefix reuses it; evicted (oldest first) before any
  allocation fails.

Invariant: free + in use + cached == total, and every count is >= 0. All methods are
synchronous: a check and the act it guards (`can_allocate` then `allocate`) never have
an `await` between them, so nothing interleaves and a release cannot be cancelled
half-way. Releasing a block more often than it was acquired is a bug and asserts.

While a forward runs, the pool is fenced (`fence()`): a block may be released then (a
cancelled request's, at once), but none is handed out (allocated, or revived from the
cache), because the running forward may still write a block it was given before the
release. The step actor schedules, and so allocates, only between forwards; the fence
asserts it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import attrs


@attrs.frozen
class PoolStats:
    total: int
    free: int
    in_use: int
    cached: int


class BlockPool:
    """Reference-counted block ids with a free list and an evictable prefix cache."""

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("the block pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._num_in_use = 0
        self._fenced = False

    # -- counts ---------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_in_use(self) -> int:
        return self._num_in_use

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: free ones, then evictable cached ones."""
        return len(self._free) + len(self._cached)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._cached

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, self.num_free, self.num_in_use, self.num_cached)

    # -- allocation and sharing ------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (reference count 1 each), evicting cached ones if needed."""
        assert not self._fenced, "a KV block handed out while a forward runs"
        if n > self.num_available:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_available} available")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refcount[block] = 1
            blocks.append(block)
        self._num_in_use += n
        return blocks

    def acquire(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block (a prefix-cache hit, a fork, a pin)."""
        refcount = self._refcount
        for block in blocks:
            if refcount[block] == 0:
                # Only a cached block may be revived; a free one has no content.
                assert block in self._cached, f"block {block} is free, not cached"
                assert not self._fenced, "a KV block revived while a forward runs"
                del self._cached[block]
                self._num_in_use += 1
            refcount[block] += 1

    def fork(self, blocks: list[int]) -> list[int]:
        """Share every block of a sequence with a child: +1 on each; returns its table."""
        self.acquire(blocks)
        return list(blocks)

    def release(self, blocks: Iterable[int]) -> int:
        """Drop one reference on each block; returns how many reached zero."""
        refcount = self._refcount
        freed = 0
        for block in blocks:
            count = refcount[block]
            assert count > 0, f"double free of KV block {block}"
            refcount[block] = count - 1
            if count == 1:
                freed += 1
                if block in self._hash_of:
                    self._cached[block] = None  # most recently used at the end
                else:
                    self._free.append(block)
        self._num_in_use -= freed
        return freed

    def copy_on_write(self, block: int) -> int | None:
        """Before writing into `block`: a private replacement if it is shared, else None.

        The caller owns one reference on `block`; when others hold it too, that
        reference moves to a fresh block whose content the caller must copy over.
        """
        if self._refcount[block] == 1:
            return None
        (fresh,) = self.allocate(1)
        self.release((block,))
        return fresh

    @contextmanager
    def fence(self) -> Iterator[None]:
        """While a forward runs: releases are allowed, handing blocks out is not."""
        self._fenced = True
        try:
            yield
        finally:
            self._fenced = False

    # -- prefix cache -----------------------------------------------------------

    def commit(self, block: int, block_hash: bytes) -> None:
        """Record that a full, computed `block` holds the content named by `block_hash`."""
        if not self.enable_prefix_caching or block in self._hash_of:
            return
        if block_hash in self._block_of:
            return  # the same content already has a cached block; this one stays private
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def lookup(self, block_hashes: Iterable[bytes]) -> list[int]:
        """The blocks holding the longest cached prefix of `block_hashes` (not acquired)."""
        hits = []
        if self.enable_prefix_caching:
            for block_hash in block_hashes:
                block = self._block_of.get(block_hash)
                if block is None:
                    break
                hits.append(block)
        return hits

    def forget_contents(self) -> None:
        """The K/V tensors' contents are gone (a model worker died with them): no block
        names cached content any more. Cached blocks become free; blocks in use are
        freed, not cached, when released."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._hash_of.clear()
        self._block_of.clear()

    # -- checking ---------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the pool's invariants; cheap enough to run after every test."""
        refcount = self._refcount
        free = set(self._free)
        cached = set(self._cached)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & cached, "a block is both free and cached"
        in_use = {b for b, c in enumerate(refcount) if c > 0}
        assert all(c >= 0 for c in refcount), "negative reference count"
        assert not in_use & (free | cached), "a referenced block is free or cached"
        assert len(free) + len(cached) + len(in_use) == self.num_blocks, "blocks lost"
        assert len(in_use) == self._num_in_use, "in-use count drifted"
        assert all(b in self._hash_of for b in cached), "an unhashed block is cached"
        assert all(self._block_of[h] == b for b, h in self._hash_of.items()), "hash maps differ"
