"""Scheduler: priorities, FCFS, chunked prefill, the caps, admission by free blocks,
preemption by recompute, prefix and parent sharing; invariants under random operation
sequences (hypothesis stateful testing)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvscope.actors.messages import RequestStatus
from kvscope.actors.scheduler import Scheduler
from kvscope.actors.sequence import Sequence
from kvscope.cache.block_pool import BlockPool
from kvscope.cache.block_table import blocks_needed


def make(
    num_blocks: int = 16,
    *,
    block_size: int = 4,
    budget: int = 64,
    seqs: int = 8,
    watermark: float = 0.0,
):
    pool = BlockPool(num_blocks)
    return pool, Scheduler(
        pool,
        block_size=block_size,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        watermark=watermark,
    )


def run_step(scheduler: Scheduler, next_token: int = 1):
    """Schedule one step and advance it as the step actor would (token = next_token)."""
    step = scheduler.schedule()
    for seq, n in step.chunks:
        scheduler.advance(seq, n)
        if seq.num_computed == len(seq.tokens):
            seq.tokens.append(next_token)
    return step


def test_priority_classes_then_fcfs():
    _, sched = make(seqs=2)
    for i in range(2):
        sched.add(Sequence(f"n{i}", [1, 2]))
    sched.add(Sequence("u", [1, 2], priority=-1))  # arrives last, more urgent
    step = sched.schedule()
    assert [s.id for s, _ in step.chunks] == ["u", "n0"]
    assert sched.num_waiting == 1


def test_chunked_prefill_respects_the_token_budget():
    pool, sched = make(budget=6)
    seq = Sequence("a", list(range(14)))
    sched.add(seq)
    assert [n for _, n in run_step(sched).chunks] == [6]
    assert seq.block_table == [0, 1]
    assert [n for _, n in run_step(sched).chunks] == [6]
    assert [n for _, n in run_step(sched).chunks] == [2]
    assert seq.num_computed == 14 and len(seq.tokens) == 15  # sampled after the last chunk
    assert [n for _, n in run_step(sched).chunks] == [1]  # then decodes
    pool.check_integrity()


def test_decode_comes_before_new_prefill_in_the_budget():
    _, sched = make(budget=4)
    first = Sequence("a", [1, 2, 3])
    sched.add(first)
    run_step(sched)
    sched.add(Sequence("b", list(range(10))))
    step = sched.schedule()
    assert [(s.id, n) for s, n in step.chunks] == [("a", 1), ("b", 3)]


def test_admission_keeps_the_watermark():
    pool, sched = make(num_blocks=10, watermark=0.2)  # 2 blocks kept free
    big = Sequence("big", list(range(32)))  # needs 8 blocks: leaves exactly 2
    sched.add(big)
    sched.add(Sequence("next", [1, 2, 3]))
    step = sched.schedule()
    assert [s.id for s, _ in step.chunks] == ["big"]
    assert pool.num_available == 2 and sched.num_waiting == 1


def test_preemption_frees_the_least_urgent_most_recent_and_it_resumes():
    pool, sched = make(num_blocks=4, block_size=2)
    old = Sequence("old", [1, 2, 3])  # 2 blocks
    new = Sequence("new", [4, 5, 6])  # 2 blocks
    sched.add(old)
    sched.add(new)
    run_step(sched)  # both prefilled; the pool is full
    assert pool.num_available == 0
    run_step(sched)  # old decodes into its 2nd block's free slot
    step = run_step(sched)  # old needs a 3rd block: new is preempted
    assert [s.id for s in step.preempted] == ["new"]
    assert new.status is RequestStatus.PREEMPTED and new.block_table == [] and new.num_computed == 0
    assert sched.num_waiting == 1
    generated = new.num_generated
    sched.remove(old)
    run_step(sched)  # new is readmitted and recomputes prompt + generated tokens
    assert new.status is RequestStatus.RUNNING
    assert new.num_generated == generated + 1
    pool.check_integrity()


def test_an_end_is_never_undone_and_only_the_release_follows_it():
    seq = Sequence("a", [1, 2])
    seq.status = RequestStatus.FINISHED
    for later in (RequestStatus.PREEMPTED, RequestStatus.RUNNING, RequestStatus.CANCELLED):
        seq.status = later
        assert seq.status is RequestStatus.FINISHED
    seq.status = RequestStatus.RELEASED
    assert seq.status is RequestStatus.RELEASED and seq.status.is_final


def test_an_ended_sequence_preempted_before_it_leaves_stays_ended_and_leaves_cleanly():
    pool, sched = make(num_blocks=4, block_size=2)
    old = Sequence("old", [1, 2, 3])
    new = Sequence("new", [4, 5, 6])
    sched.add(old)
    sched.add(new)
    run_step(sched)
    run_step(sched)
    new.status = RequestStatus.FINISHED  # its request ended; its cleanup has not run yet
    step = run_step(sched)  # old needs a 3rd block: the ended one is the victim
    assert [s.id for s in step.preempted] == ["new"]
    assert new.status is RequestStatus.FINISHED and new.block_table == []
    run_step(sched)
    assert new not in sched.running  # never readmitted
    assert sched.remove(new) == 0 and sched.num_waiting == 0
    assert sched.remove(old) > 0
    assert pool.num_in_use == 0 and not sched.has_work()
    pool.check_integrity()


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_least_urgent():
    pool, sched = make(num_blocks=2, block_size=2)
    urgent = Sequence("urgent", [1, 2], priority=0)
    lazy = Sequence("lazy", [3], priority=5)
    sched.add(urgent)
    sched.add(lazy)
    run_step(sched)  # urgent: 1 block (+1 token -> full), lazy: 1 block
    run_step(sched)  # urgent needs block 2 of 2: lazy is preempted
    assert lazy.status is RequestStatus.PREEMPTED
    assert urgent.status is RequestStatus.RUNNING
    pool.check_integrity()


def test_max_num_seqs_caps_the_batch():
    _, sched = make(seqs=3)
    for i in range(5):
        sched.add(Sequence(str(i), [1]))
    assert len(sched.schedule().chunks) == 3


def test_repeated_prompt_reuses_cached_blocks():
    pool, sched = make(num_blocks=16, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    first = Sequence("first", prompt)
    sched.add(first)
    run_step(sched)
    table = list(first.block_table)
    sched.remove(first)
    assert pool.num_cached == 2  # the 2 full blocks stay cached
    second = Sequence("second", prompt)
    sched.add(second)
    step = sched.schedule()
    assert step.chunks == [(second, 2)]  # only the tail is computed
    assert second.block_table[:2] == table[:2]


def test_a_fully_cached_prompt_still_computes_its_last_block():
    pool, sched = make(num_blocks=16, block_size=4)
    prompt = list(range(8))
    first = Sequence("first", prompt)
    sched.add(first)
    run_step(sched)
    sched.remove(first)
    again = Sequence("again", prompt)
    sched.add(again)
    assert sched.schedule().chunks == [(again, 4)]


def test_child_waits_for_parent_prefix_then_forks_its_blocks_and_copies_on_write():
    pool, sched = make(num_blocks=16, block_size=4, budget=64)
    parent = Sequence("p", list(range(10)))
    sched.add(parent)
    child = Sequence("c", list(range(10)), fork_from=parent)
    sched.add(child)
    step = sched.schedule()
    assert [s.id for s, _ in step.chunks] == ["p"]  # the child waits for the prefix
    for seq, n in step.chunks:
        sched.advance(seq, n)
    parent.tokens.append(99)
    in_use = pool.num_in_use
    step = sched.schedule()
    assert (child, 1) in step.chunks  # it recomputes only the last prompt token
    assert child.block_table[:2] == parent.block_table[:2]  # full blocks shared
    assert child.block_table[2] != parent.block_table[2]  # partial block copied on write
    assert (parent.block_table[2], child.block_table[2]) in step.copies
    assert pool.num_in_use == in_use + 1 + 0  # only the copied block is new
    pool.check_integrity()


def test_remove_is_idempotent_and_releases_everything():
    pool, sched = make()
    seq = Sequence("a", list(range(9)))
    sched.add(seq)
    run_step(sched)
    assert sched.remove(seq) == 3
    assert sched.remove(seq) == 0
    assert pool.num_in_use == 0 and not sched.has_work()


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, steps, finishes, cancels and forks on a tiny pool."""

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.sched = make(num_blocks=10, block_size=2, budget=7, seqs=4, watermark=0.1)
        self.live: list[Sequence] = []
        self.count = 0

    @rule(length=st.integers(1, 9), priority=st.integers(0, 2), fork=st.booleans())
    def arrive(self, length: int, priority: int, fork: bool) -> None:
        self.count += 1
        parent = self.live[-1] if fork and self.live else None
        prompt = (parent.tokens[:length] if parent else []) + [self.count] * length
        seq = Sequence(str(self.count), prompt[:9] or [1], priority=priority, fork_from=parent)
        self.sched.add(seq)
        self.live.append(seq)

    @rule()
    def step(self) -> None:
        run_step(self.sched, next_token=self.count % 7)
        for seq in self.sched.running:
            assert len(seq.block_table) >= blocks_needed(seq.num_computed, 2)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        seq = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.sched.remove(seq)

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        waiting = [
            s for s in self.live if s.status in (RequestStatus.QUEUED, RequestStatus.PREEMPTED)
        ]
        assert self.sched.num_waiting == len(waiting)
        running = [s for s in self.live if s.status is RequestStatus.RUNNING]
        assert sorted(map(id, running)) == sorted(map(id, self.sched.running))
        held = sum(len(s.block_table) for s in self.live)
        assert held >= self.pool.num_in_use  # shared blocks are counted once in the pool
        for seq in waiting:
            assert seq.block_table == []

    def teardown(self) -> None:
        for seq in self.live:
            self.sched.remove(seq)
        self.pool.check_integrity()
        assert self.pool.num_in_use == 0 and not self.sched.has_work()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
