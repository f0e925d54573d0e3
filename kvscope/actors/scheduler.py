"""The scheduler: which sequences run in the next step, and which KV blocks they get.

It owns the waiting queue and the running list and, through them, every sequence's
block table. It is synchronous and used by one task at a time (the step actor
schedules and advances; a request's cleanup removes), so no check is ever separated
from its act by an `await`.

A `Sequence` (`sequence.py`) is the scheduler's view of one request: its tokens, how
many of them have their K/V in the cache (`num_computed`), its block table and block
hashes.
"""

from __future__ import annotations

import heapq
import math
import time

import attrs

from kvscope.cache.block_pool import BlockPool
from kvscope.cache.block_table import blocks_needed, extend_hashes

from .messages import RequestStatus
from .sequence import Sequence
from .step_budget import StepTimeBudget


@attrs.frozen
class ScheduledStep:
    """What the next step computes: (sequence, number of new tokens) pairs, and the
    block copies (source, destination) that copy-on-write asks for before it runs."""

    chunks: list[tuple[Sequence, int]]
    copies: list[tuple[int, int]]
    preempted: list[Sequence]


class Scheduler:
    """Priority classes, FCFS within one, chunked prefill under a token budget."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark: float = 0.01,
        max_step_seconds: float = 0.0,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        #: Bounds a step's prefill tokens by time (fed the step times by the step actor).
        self.step_budget = StepTimeBudget(max_step_seconds, floor=block_size)
        self.watermark_blocks = math.ceil(watermark * pool.num_blocks)
        self._waiting: list[tuple[int, int, Sequence]] = []  # heap; removed entries stay
        self._num_waiting = 0
        self.running: list[Sequence] = []
        #: Prompt tokens admitted, and those of them found computed (a cached prefix or
        #: a parent's blocks): the prefix-cache hit rate (kvscope.replicas routes by it).
        self.prompt_tokens_admitted = 0
        self.prompt_tokens_reused = 0
        #: Every sequence added and not yet removed (waiting or running).
        self._members: set[Sequence] = set()

    # -- membership --------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def adapters(self) -> tuple[set[str], set[str]]:
        """The LoRA adapters of the running sequences, and of the waiting ones."""
        waiting = self._members.difference(self.running)
        running = {seq.params.lora for seq in self.running if seq.params.lora}
        return running, {seq.params.lora for seq in waiting if seq.params.lora}

    def add(self, seq: Sequence) -> None:
        seq.status = RequestStatus.QUEUED
        self._members.add(seq)
        self._push_waiting(seq)

    def remove(self, seq: Sequence) -> int:
        """Take `seq` out for good and drop its block references (idempotent).

        Returns how many block references it dropped. Blocks pinned by the running
        step stay allocated until the step unpins them (`StepActor.leave`).
        """
        if seq not in self._members:
            return 0
        self._members.discard(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self._num_waiting -= 1  # its heap entry is dropped lazily
        dropped = len(seq.block_table)
        self.pool.release(seq.block_table)
        seq.block_table = []
        return dropped

    # -- scheduling ---------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        """Pick the next step.

        Running sequences go first, most urgent first, each taking one decode token (and
        a slot for each token of its draft, `Sequence.draft`) or its next prefill chunk
        out of the token budget (prefill chunks also out of the
        prefill tokens that fit in the step's time, `step_budget`); when one needs a
        block and none is free, the least urgent, most recent running sequence is
        preempted (its blocks freed, it requeues and later recomputes). Then waiting
        sequences are admitted in priority order, FCFS within a class, while both
        budgets, the sequence cap and the free blocks above the watermark allow, reusing
        cached prefix blocks or their parent's blocks.
        """
        budget = self.max_num_batched_tokens
        chunks: list[tuple[Sequence, int]] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        self.running.sort(key=_sort_key)
        decoding = sum(1 for seq in self.running if len(seq.tokens) - seq.num_computed == 1)
        prefill = self.step_budget.prefill_tokens(decoding, budget)

        index = 0
        while index < len(self.running) and budget and len(chunks) < self.max_num_seqs:
            seq = self.running[index]
            index += 1
            if seq.skippable():
                continue
            num_new = min(len(seq.tokens) - seq.num_computed, budget)
            is_prefill = num_new > 1
            if is_prefill:
                num_new = min(num_new, prefill)
                if not num_new:
                    continue  # no time left in this step for its next chunk
            elif seq.draft:  # a decode row verifies its draft: a slot for each token
                seq.draft = seq.draft[: budget - 1]
                num_new += len(seq.draft)
            while not self._reserve(seq, num_new, copies):
                victim = self._least_urgent_running()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is RequestStatus.RUNNING:
                chunks.append((seq, num_new))
                budget -= num_new
                prefill -= num_new if is_prefill else 0

        if not preempted:
            self._admit(chunks, copies, min(budget, prefill))
        return ScheduledStep(chunks, copies, preempted)

    def advance(self, seq: Sequence, num_new: int) -> None:
        """After a step computed `num_new` tokens of `seq`: count them, and register
        its newly full blocks in the prefix cache."""
        seq.num_computed += num_new
        full = seq.num_computed // self.block_size
        if full > seq.num_committed:
            extend_hashes(
                seq.block_hashes, seq.tokens, seq.num_computed, self.block_size, seq.cache_salt
            )
            for index in range(seq.num_committed, full):
                self.pool.commit(seq.block_table[index], seq.block_hashes[index])
            seq.num_committed = full

    def recompute_all(self) -> int:
        """The K/V cache's contents are gone (the model worker that held them died):
        every running sequence is preempted, to compute its tokens again, and the prefix
        cache forgets its blocks. Returns how many were preempted."""
        lost = [seq for seq in self.running if not seq.status.is_final]
        for seq in lost:
            self._preempt(seq)
        self.pool.forget_contents()
        return len(lost)

    # -- helpers --------------------------------------------------------------------

    def _push_waiting(self, seq: Sequence) -> None:
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))
        self._num_waiting += 1

    def _least_urgent_running(self) -> Sequence:
        return max(self.running, key=_sort_key)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_committed = 0
        seq.draft = []
        seq.num_preemptions += 1
        seq.status = RequestStatus.PREEMPTED
        self._push_waiting(seq)

    def _reserve(self, seq: Sequence, num_new: int, copies: list[tuple[int, int]]) -> bool:
        """Give `seq` private blocks for its next `num_new` slots, if the pool can."""
        pool, table = self.pool, seq.block_table
        first_written = seq.num_computed // self.block_size
        shared = [i for i in range(first_written, len(table)) if pool.refcount(table[i]) > 1]
        extra = blocks_needed(seq.num_computed + num_new, self.block_size) - len(table)
        if not pool.can_allocate(len(shared) + max(extra, 0)):
            return False
        for i in shared:
            fresh = pool.copy_on_write(table[i])
            assert fresh is not None
            copies.append((table[i], fresh))
            table[i] = fresh
        if extra > 0:
            table.extend(pool.allocate(extra))
        return True

    def _admit(
        self, chunks: list[tuple[Sequence, int]], copies: list[tuple[int, int]], budget: int
    ) -> int:
        deferred: list[Sequence] = []
        while self._waiting and budget and len(chunks) < self.max_num_seqs:
            seq = self._waiting[0][2]
            if seq not in self._members or seq.status.is_final:
                heapq.heappop(self._waiting)
                continue
            if seq.skippable() or self._waits_for_parent(seq):
                heapq.heappop(self._waiting)
                deferred.append(seq)
                continue
            num_new = self._claim_prefix(seq, budget, copies)
            if num_new is None:
                break
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            seq.status = RequestStatus.RUNNING
            self.running.append(seq)
            chunks.append((seq, num_new))
            budget -= num_new
        for seq in deferred:
            heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))
        return budget

    def _waits_for_parent(self, seq: Sequence) -> bool:
        parent = seq.fork_from
        return (
            parent is not None
            and parent.status is RequestStatus.RUNNING
            and parent in self._members
            and parent.num_computed < seq.share_target
        )

    def _claim_prefix(
        self, seq: Sequence, budget: int, copies: list[tuple[int, int]]
    ) -> int | None:
        """Set up `seq`'s first blocks (shared prefix + its first chunk) if they fit
        above the watermark; returns the chunk's token count, or None to wait."""
        pool, size = self.pool, self.block_size
        shared, num_computed = self._shared_prefix(seq)
        num_new = min(len(seq.tokens) - num_computed, budget)
        revived = sum(1 for b in shared if pool.refcount(b) == 0)  # leave the cache
        partial = 1 if num_computed % size else 0  # a shared partial block is copied
        new = blocks_needed(num_computed + num_new, size) - len(shared) + partial
        if pool.num_available - revived - new < self.watermark_blocks:
            return None
        pool.acquire(shared)
        self.prompt_tokens_admitted += len(seq.tokens)
        self.prompt_tokens_reused += num_computed
        if seq.num_cached_prompt is None:
            seq.num_cached_prompt = num_computed
            seq.first_admitted_at = time.perf_counter()
        seq.block_table = list(shared)
        seq.num_computed = num_computed
        seq.num_committed = num_computed // size
        reserved = self._reserve(seq, num_new, copies)
        assert reserved, "admission checked the blocks it reserves"
        return num_new

    def _shared_prefix(self, seq: Sequence) -> tuple[list[int], int]:
        """Blocks `seq` can share (its parent's, else cached ones) and the tokens they
        cover; at least one token is always left to compute, for the logits. A
        sequence with `prompt_logprobs` shares none: it needs every prompt token's
        logits (its `share_target` is 0, and its full blocks still enter the cache)."""
        size = self.block_size
        parent = seq.fork_from
        if parent is not None and parent.block_table and parent in self._members:
            shared_tokens = min(seq.share_target, parent.num_computed)
            if shared_tokens:
                seq.block_hashes = parent.block_hashes[: shared_tokens // size]
                return parent.block_table[: blocks_needed(shared_tokens, size)], shared_tokens
        extend_hashes(seq.block_hashes, seq.tokens, len(seq.tokens), size, seq.cache_salt)
        if seq.params.prompt_logprobs is not None:
            return [], 0
        hits = self.pool.lookup(seq.block_hashes)
        hits = hits[: (len(seq.tokens) - 1) // size]
        return hits, len(hits) * size


def _sort_key(seq: Sequence) -> tuple[int, int]:
    return (seq.priority, seq.arrival)
