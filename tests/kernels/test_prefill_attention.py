"""`paged_attention`'s prefill paths against each row attended on its own: chunks that
start their sequences attend their own rows (consecutive ones of one length in one
call), other chunks their gathered blocks; the same values either way."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import attention
from tests.kernels.conftest import attend_in_pieces

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 16


@pytest.fixture
def torch_paths(monkeypatch):
    """The torch paths only (no compiled kernel), whatever this machine has."""
    monkeypatch.setenv("KVSCOPE_ATTENTION", "reference")
    attention.decode_backend.cache_clear()
    yield
    attention.decode_backend.cache_clear()


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "in pieces"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_major", [True, False], ids=["block-major", "head-major"])
def test_fresh_and_later_chunks_attend_as_each_row_on_its_own(
    torch_paths, dtype, block_major, sliced
) -> None:
    """The same in pieces: each run of fresh chunks cut into one call a chunk, and the
    later chunk into one call a row, with a checkpoint before each (after the decode
    rows too)."""
    # Two decode rows; three fresh prompts of 6 tokens (one run), a fresh one of 9, a
    # later chunk of a prompt (3 tokens in the cache), then another fresh one of 6
    # (a run of its own: not next to the first three).
    starts = [5, 2, 0, 0, 0, 0, 3, 0]
    lengths = [1, 1, 6, 6, 6, 9, 5, 6]
    generator = torch.Generator().manual_seed(0)
    widths = [-(-(s + n) // BLOCK) for s, n in zip(starts, lengths, strict=True)]
    num_blocks = sum(widths) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [[order.pop() for _ in range(width)] for width in widths]
    meta = attention.build_metadata(
        starts=starts,
        lengths=lengths,
        block_tables=tables,
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    assert [(run.start, run.count, run.length) for run in meta.fresh_runs] == [
        (2, 3, 6),
        (20, 1, 9),
        (34, 1, 6),
    ]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    if block_major:
        keys, values = (
            rand(num_blocks, BLOCK, KV_HEADS, DIM),
            rand(num_blocks, BLOCK, KV_HEADS, DIM),
        )
    else:
        keys = rand(KV_HEADS, num_blocks, BLOCK, DIM).permute(1, 2, 0, 3)
        values = rand(KV_HEADS, num_blocks, BLOCK, DIM).permute(1, 2, 0, 3)
    tokens = sum(lengths)
    # q, k and v as the model hands them over: views into one fused projection.
    qkv = rand(tokens, (HEADS + 2 * KV_HEADS) * DIM)
    query = qkv[:, : HEADS * DIM].view(tokens, HEADS, DIM)
    key = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(tokens, KV_HEADS, DIM)
    value = qkv[:, (HEADS + KV_HEADS) * DIM :].view(tokens, KV_HEADS, DIM)
    scale = DIM**-0.5
    if sliced:
        out, checkpoints = attend_in_pieces(query, key, value, keys, values, meta, scale)
        # after a checkpoint each: a fresh chunk a piece, a row of the later chunk a piece
        assert checkpoints == 3 + 1 + 1 + 5
    else:
        out = attention.paged_attention(query, key, value, keys, values, meta, scale)

    # Each row on its own over the cache as the step left it: its sequence's blocks,
    # up to and including its own position.
    rows = torch.repeat_interleave(torch.arange(len(starts)), torch.tensor(lengths))
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    width = max(widths)
    padded = torch.tensor([table + [0] * (width - len(table)) for table in tables])
    expected = attention.reference_decode(
        query, keys, values, padded[rows], (positions + 1).to(torch.int32), scale
    )
    assert out.shape == (tokens, HEADS * DIM)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    error = (out.float() - expected.reshape(tokens, -1).float()).abs().max()
    assert error <= tolerance * expected.float().abs().max()
