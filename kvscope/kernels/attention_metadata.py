"""Where a step's tokens go in attention: `AttentionMetadata`, built once per step (not
once per layer) by `build_metadata` from the chunks' starts, lengths and block tables.

The step's tokens are laid out flat: first one token for each decoding sequence, then the
prefill chunks one after another (`PrefillSpan`). Consecutive chunks that the compiled
CPU kernel may attend in place form a `PrefillRun`; consecutive chunks that start their
sequence, of one length, a `FreshRun` (`attention.py` says how each is attended).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from .reference import padding_mask

#: Longest context (in tokens, the chunk's own included) of a prefill chunk that the
#: compiled CPU kernel may attend in place; longer chunks take SDPA. (Measured
#: for the decode kernel row by row on a CPU without AMX, where it beat SDPA to 1,024.)
IN_PLACE_PREFILL_CONTEXT = 768


@attrs.frozen
class PrefillSpan:
    start: int  # first row of the chunk in the flat token layout
    end: int
    blocks: torch.Tensor  # [num_blocks] block ids covering the context
    context_len: int  # tokens in the cache once this chunk is written
    mask: torch.Tensor | None  # [chunk, context] bool, None when causal from position 0
    #: Its context is at most IN_PLACE_PREFILL_CONTEXT: a kernel that reads the blocks
    #: in place may take it (in its `PrefillRun`).
    in_place: bool = False


@attrs.frozen
class PrefillRun:
    """Consecutive `in_place` prefill chunks, for one call of a kernel that reads the
    blocks in place: rows `start`..`end` of the step, chunk c's rows from `offsets[c]`
    (relative to `start`), its first token at position `starts[c]`."""

    start: int
    end: int
    tables: torch.Tensor  # [chunks, max_blocks] block ids of each (padded with block 0)
    starts: torch.Tensor  # [chunks] int32
    offsets: torch.Tensor  # [chunks + 1] int32

    def chunks(self) -> list[tuple[int, int, int]]:
        """(first position, first row, end row) of each chunk, read off its tensors
        (on the CPU: only CPU chunks attend in place, so reading them costs no sync)."""
        offsets = self.offsets.tolist()
        return list(zip(self.starts.tolist(), offsets, offsets[1:], strict=False))

    @property
    def keys(self) -> int:
        """The keys its rows attend, summed (its work)."""
        return sum(chunk_keys(start, end - begin) for start, begin, end in self.chunks())


@attrs.frozen
class FreshRun:
    """`count` consecutive prefill chunks of `length` tokens each, from row `start`, each
    the start of its sequence: their keys and values are their own rows of the step."""

    start: int
    count: int
    length: int
    in_place: bool  # (their PrefillSpan's)

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.count * self.length)

    @property
    def keys(self) -> int:
        """The keys its rows attend, summed (its work)."""
        return self.count * chunk_keys(0, self.length)


@attrs.frozen
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each token
    num_decode: int
    decode_tables: torch.Tensor | None  # [num_decode, max_blocks] (padded with block 0)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] bool
    decode_context_lens: torch.Tensor | None  # [num_decode] tokens each decode row attends
    prefills: tuple[PrefillSpan, ...]
    prefill_runs: tuple[PrefillRun, ...] = ()  # the `in_place` chunks, in runs
    fresh_runs: tuple[FreshRun, ...] = ()  # the chunks with no `mask`, in runs


def build_metadata(
    *,
    starts: Sequence[int],
    lengths: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for sequences laid out in order, those with `length == 1` first.

    `starts[i]` is how many tokens of sequence i are already in the cache, `lengths[i]`
    how many this step adds, `block_tables[i]` its blocks. A decode row's slot is one
    Python expression; a prefill chunk's slots are computed as tensors, not token by
    token (a small saving: ~0.06 ms of a mixed step's ~0.5 ms of metadata).
    """
    num_decode = 0
    while num_decode < len(lengths) and lengths[num_decode] == 1:
        num_decode += 1
    decode_slots = [
        block_tables[i][starts[i] // block_size] * block_size + starts[i] % block_size
        for i in range(num_decode)
    ]
    slot_pieces = [torch.tensor(decode_slots, dtype=torch.long)]
    decode_tables = decode_mask = lens = None
    if num_decode:
        context = [starts[i] + 1 for i in range(num_decode)]
        width = max(len(block_tables[i]) for i in range(num_decode))
        padded = [
            list(block_tables[i]) + [0] * (width - len(block_tables[i])) for i in range(num_decode)
        ]
        decode_tables = torch.tensor(padded, dtype=torch.long, device=device)
        lens = torch.tensor(context, dtype=torch.int32, device=device)
        decode_mask = padding_mask(lens, width * block_size)

    prefills = []
    row = num_decode
    for i in range(num_decode, len(lengths)):
        start, length = starts[i], lengths[i]
        context_len = start + length
        num_blocks = -(-context_len // block_size)
        blocks = torch.tensor(block_tables[i][:num_blocks], dtype=torch.long)
        positions = torch.arange(start, context_len)
        slot_pieces.append(blocks[positions // block_size] * block_size + positions % block_size)
        mask = None
        if start:
            q_pos = torch.arange(start, context_len, device=device)
            k_pos = torch.arange(context_len, device=device)
            mask = k_pos[None, :] <= q_pos[:, None]
        in_place = device.type == "cpu" and context_len <= IN_PLACE_PREFILL_CONTEXT
        prefills.append(
            PrefillSpan(row, row + length, blocks.to(device), context_len, mask, in_place)
        )
        row += length
    slot_mapping = torch.cat(slot_pieces) if len(slot_pieces) > 1 else slot_pieces[0]
    return AttentionMetadata(
        slot_mapping.to(device),
        num_decode,
        decode_tables,
        decode_mask,
        lens,
        tuple(prefills),
        _prefill_runs(prefills, starts[num_decode:], device),
        _fresh_runs(prefills),
    )


def _fresh_runs(prefills: list[PrefillSpan]) -> tuple[FreshRun, ...]:
    """The chunks that start their sequences, consecutive ones of one length together."""
    runs: list[FreshRun] = []
    for span in prefills:
        if span.mask is not None:
            continue
        length = span.end - span.start
        last = runs[-1] if runs else None
        if last is not None and last.length == length and last.rows.stop == span.start:
            runs[-1] = attrs.evolve(last, count=last.count + 1)
        else:
            runs.append(FreshRun(span.start, 1, length, span.in_place))
    return tuple(runs)


def _prefill_runs(
    prefills: list[PrefillSpan], starts: Sequence[int], device: torch.device
) -> tuple[PrefillRun, ...]:
    """The `in_place` chunks, consecutive ones together."""
    runs: list[list[tuple[PrefillSpan, int]]] = []
    for index, (span, start) in enumerate(zip(prefills, starts, strict=True)):
        if not span.in_place:
            continue
        if runs and prefills[index - 1].in_place:
            runs[-1].append((span, start))
        else:
            runs.append([(span, start)])
    built = []
    for run in runs:
        first = run[0][0].start
        width = max(len(span.blocks) for span, _ in run)
        tables = torch.zeros(len(run), width, dtype=torch.long)
        for row, (span, _) in enumerate(run):
            tables[row, : len(span.blocks)] = span.blocks.cpu()
        offsets = [span.start - first for span, _ in run] + [run[-1][0].end - first]
        built.append(
            PrefillRun(
                first,
                run[-1][0].end,
                tables.to(device),
                torch.tensor([start for _, start in run], dtype=torch.int32, device=device),
                torch.tensor(offsets, dtype=torch.int32, device=device),
            )
        )
    return tuple(built)


def chunk_keys(start: int, length: int) -> int:
    """The keys `length` rows from position `start` attend causally, summed."""
    return length * start + length * (length + 1) // 2
