"""`build_metadata`: where each token of a step goes in the paged cache, and what each
decode row and prefill chunk attends over."""

from __future__ import annotations

import torch

from kvscope.kernels.attention import build_metadata

BLOCK = 4


def slot(table: list[int], position: int) -> int:
    return table[position // BLOCK] * BLOCK + position % BLOCK


def test_slots_rows_and_spans_of_a_mixed_step() -> None:
    # Two decode rows (one at a block's last slot, one at a new block's first), a
    # prompt's first chunk, and a later chunk of another prompt that crosses blocks.
    tables = [[7, 2], [5, 9, 1], [3, 8, 6], [0, 4, 10, 11]]
    starts = [3, 8, 0, 5]
    lengths = [1, 1, 6, 9]
    meta = build_metadata(
        starts=starts,
        lengths=lengths,
        block_tables=tables,
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    expected = [
        slot(table, position)
        for table, start, length in zip(tables, starts, lengths, strict=True)
        for position in range(start, start + length)
    ]
    assert meta.slot_mapping.dtype == torch.long
    assert meta.slot_mapping.tolist() == expected
    assert meta.num_decode == 2
    assert meta.decode_tables is not None and meta.decode_context_lens is not None
    assert meta.decode_tables.tolist() == [[7, 2, 0], [5, 9, 1]]
    assert meta.decode_context_lens.tolist() == [4, 9]
    first, later = meta.prefills
    assert (first.start, first.end, first.context_len, first.mask) == (2, 8, 6, None)
    assert first.blocks.tolist() == [3, 8]
    assert (later.start, later.end, later.context_len) == (8, 17, 14)
    assert later.blocks.tolist() == [0, 4, 10, 11]
    assert later.mask is not None and later.mask.shape == (9, 14)
    # Row q (position 5 + q) sees positions 0 .. 5 + q.
    assert later.mask.sum(dim=1).tolist() == [6 + q for q in range(9)]
    # Both chunks are short enough for an in-place kernel: one run of their 15 rows,
    # each chunk with its blocks, where its rows begin and its first token's position.
    assert first.in_place and later.in_place
    (run,) = meta.prefill_runs
    assert (run.start, run.end) == (2, 17)
    assert run.offsets.tolist() == [0, 6, 15] and run.starts.tolist() == [0, 5]
    assert run.tables.tolist() == [[3, 8, 0, 0], [0, 4, 10, 11]]


def test_a_chunk_past_the_in_place_limit_stays_on_sdpa(monkeypatch) -> None:
    from kvscope.kernels import attention_metadata

    monkeypatch.setattr(attention_metadata, "IN_PLACE_PREFILL_CONTEXT", 8)
    meta = build_metadata(
        starts=[0, 0, 2],
        lengths=[6, 9, 4],
        block_tables=[[1, 2], [3, 4, 5], [6, 7]],
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    assert [span.in_place for span in meta.prefills] == [True, False, True]
    assert [(run.start, run.end) for run in meta.prefill_runs] == [(0, 6), (15, 19)]
    assert [run.starts.tolist() for run in meta.prefill_runs] == [[0], [2]]


def test_chunks_that_start_their_sequences_are_run_together_by_length() -> None:
    """Consecutive fresh chunks (nothing of them in the cache) of one length make one
    run; a later chunk, or another length, ends it."""
    meta = build_metadata(
        starts=[4, 0, 0, 0, 2, 0, 0],
        lengths=[1, 5, 5, 3, 5, 5, 5],
        block_tables=[[1, 2], [3, 4], [5, 6], [7], [8, 9], [10, 11], [12, 13]],
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    runs = [(run.start, run.count, run.length, run.rows) for run in meta.fresh_runs]
    assert runs == [(1, 2, 5, slice(1, 11)), (11, 1, 3, slice(11, 14)), (19, 2, 5, slice(19, 29))]


def test_an_empty_step_has_no_slots() -> None:
    meta = build_metadata(
        starts=[], lengths=[], block_tables=[], block_size=BLOCK, device=torch.device("cpu")
    )
    assert meta.slot_mapping.tolist() == [] and meta.slot_mapping.dtype == torch.long
    assert meta.num_decode == 0 and meta.prefills == ()
