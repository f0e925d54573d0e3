"""BlockPool: exact block ids for allocation, sharing, caching and eviction, and its
invariants under random operation sequences (hypothesis stateful testing)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvscope.cache.block_pool import BlockPool
from kvscope.cache.block_table import block_hash, blocks_needed, extend_hashes


def test_allocate_takes_free_blocks_in_order_and_release_returns_them():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert (pool.num_free, pool.num_in_use, pool.num_cached) == (1, 3, 0)
    assert pool.release([1, 0]) == 2
    assert pool.allocate(3) == [3, 1, 0]
    pool.check_integrity()


def test_allocating_more_than_available_fails_and_changes_nothing():
    pool = BlockPool(2)
    pool.allocate(1)
    assert not pool.can_allocate(2)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_integrity()


def test_double_free_asserts():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.release([block])


def test_fork_shares_blocks_and_releasing_one_sharer_frees_nothing():
    pool = BlockPool(4)
    parent = pool.allocate(2)
    child = pool.fork(parent)
    assert child == parent == [0, 1]
    assert [pool.refcount(b) for b in parent] == [2, 2]
    assert pool.release(parent) == 0
    assert pool.num_in_use == 2
    assert pool.release(child) == 2
    assert pool.num_free == 4


def test_copy_on_write_moves_a_shared_block_and_keeps_a_private_one():
    pool = BlockPool(4)
    (shared,) = pool.allocate(1)
    pool.fork([shared])
    fresh = pool.copy_on_write(shared)
    assert fresh == 1
    assert pool.refcount(shared) == 1 and pool.refcount(fresh) == 1
    assert pool.copy_on_write(fresh) is None


def test_hashed_blocks_are_cached_on_release_and_found_by_prefix():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    ha = block_hash(None, [1, 2])
    hb = block_hash(ha, [3, 4])
    pool.commit(a, ha)
    pool.commit(b, hb)
    pool.release([a, b])
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (2, 2, 0)
    assert pool.lookup([ha, hb, block_hash(hb, [5, 6])]) == [a, b]
    assert pool.lookup([hb]) == [b]  # lookup is by hash; chaining makes prefixes unique
    pool.acquire([a])  # a cache hit revives the block
    assert pool.refcount(a) == 1 and not pool.is_cached(a)
    pool.check_integrity()


def test_eviction_takes_free_blocks_first_then_least_recently_used_cached():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks[:2]):
        pool.commit(block, block_hash(None, [i]))
    pool.release([blocks[1]])  # cached, older
    pool.release([blocks[0]])  # cached, newer
    pool.release([blocks[2]])  # plain free
    assert pool.allocate(1) == [blocks[2]]
    assert pool.allocate(1) == [blocks[1]]  # the LRU cached block is evicted
    assert pool.lookup([block_hash(None, [1])]) == []
    assert pool.lookup([block_hash(None, [0])]) == [blocks[0]]
    pool.check_integrity()


def test_same_content_in_two_blocks_caches_only_one():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    h = block_hash(None, [7])
    pool.commit(a, h)
    pool.commit(b, h)
    pool.release([a, b])
    assert pool.num_cached == 1 and pool.num_free == 1


def test_forgetting_the_contents_frees_cached_blocks_and_uncaches_held_ones():
    """A model worker died with the K/V tensors' contents: no block is found by its hash
    any more, cached ones are free at once, and a block still held is freed (not
    cached) when released."""
    pool = BlockPool(3)
    held, cached, _ = pool.allocate(3)
    pool.commit(held, block_hash(None, [1]))
    pool.commit(cached, block_hash(None, [2]))
    pool.release([cached])
    pool.forget_contents()
    assert pool.lookup([block_hash(None, [1])]) == [] == pool.lookup([block_hash(None, [2])])
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (1, 0, 2)
    pool.release([held])
    assert (pool.num_free, pool.num_cached) == (2, 0)
    pool.check_integrity()


def test_prefix_caching_disabled_caches_nothing():
    pool = BlockPool(2, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    pool.commit(a, block_hash(None, [1]))
    pool.release([a])
    assert pool.num_cached == 0 and pool.lookup([block_hash(None, [1])]) == []


def test_hash_chain_and_block_arithmetic():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    hashes: list[bytes] = []
    extend_hashes(hashes, [1, 2, 3, 4, 5], 5, 2)
    assert len(hashes) == 2
    assert hashes[1] == block_hash(hashes[0], [3, 4])
    other: list[bytes] = []
    extend_hashes(other, [9, 9, 3, 4], 4, 2)
    assert other[1] != hashes[1]  # same block, different prefix


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / fork / write (copy-on-write) / commit / release / evict."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8)
        self.tables: list[list[int]] = []  # each a sequence's references
        self.hashes = 0

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        if self.pool.can_allocate(n):
            self.tables.append(self.pool.allocate(n))
        else:
            with pytest.raises(MemoryError):
                self.pool.allocate(n)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        table = data.draw(st.sampled_from(self.tables))
        self.tables.append(self.pool.fork(table))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        table = data.draw(st.sampled_from(self.tables))
        index = data.draw(st.integers(0, len(table) - 1))
        shared = self.pool.refcount(table[index]) > 1
        if shared and not self.pool.can_allocate(1):
            return
        fresh = self.pool.copy_on_write(table[index])
        assert (fresh is not None) == shared
        if fresh is not None:
            table[index] = fresh
        assert self.pool.refcount(table[index]) == 1 or not shared

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        table = data.draw(st.sampled_from(self.tables))
        self.hashes += 1
        self.pool.commit(table[0], block_hash(None, [self.hashes % 5]))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        table = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        self.pool.release(table)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def revive_from_cache(self, data: st.DataObject) -> None:
        cached = [b for b in range(self.pool.num_blocks) if self.pool.is_cached(b)]
        if cached:
            block = data.draw(st.sampled_from(cached))
            self.pool.acquire([block])
            self.tables.append([block])

    @invariant()
    def counts_match_references(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for table in self.tables:
            for block in table:
                held[block] = held.get(block, 0) + 1
        for block in range(self.pool.num_blocks):
            assert self.pool.refcount(block) == held.get(block, 0)

    def teardown(self) -> None:
        for table in self.tables:
            self.pool.release(table)
        self.pool.check_integrity()
        assert self.pool.num_in_use == 0
        assert self.pool.num_free + self.pool.num_cached == self.pool.num_blocks


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
