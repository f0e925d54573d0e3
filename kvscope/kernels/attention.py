"""Reference paged attention in torch: writes new K/V into the paged cache through a
slot mapping, then attends each query over its sequence's blocks.

A step's tokens are laid out flat: first one token for each decoding sequence, then the
prefill chunks one after another. `AttentionMetadata` is built once per step (not once
per layer) and says where each goes:

* decode rows `[0, num_decode)` attend, as one batched `scaled_dot_product_attention`
  call, over their gathered blocks with a padding mask;
* a prefill chunk that starts its sequence (nothing of it in the cache before) attends
  its own rows of the step's keys and values, causally, without reading the cache;
  consecutive such chunks of one length in one SDPA call (`FreshRun`: 8 x 256 tokens of
  the reference model's heads, 2.7 against 3.8 ms gathered one chunk at a time, the
  same values);
* any other prefill chunk attends over its gathered blocks with a causal mask shifted
  by the tokens already in the cache.

There are no per-token Python loops; grouped-query attention uses SDPA's `enable_gqa`.

The decode rows go through `decode_backend(device)`: the compiled C++ kernel
(`cpu_decode.py`, built in the background on first use) for CPU tensors, the Triton
kernel (`triton_attention.py`) for CUDA tensors, torch_npu's fused attention (`npu.py`)
for Ascend tensors, and `reference_decode` here otherwise, or while the device's kernel
is unavailable. Setting `KVSCOPE_ATTENTION=reference` forces the reference everywhere.
The device modules are imported lazily, on the first step on their device.

On the CPU, a prefill chunk whose context (the tokens before it and its own) is at
most `IN_PLACE_PREFILL_CONTEXT` may go through the compiled kernel's `paged_prefill`
instead (`PrefillRun`, built once per step: consecutive such chunks in one call), which
reads the blocks in place, a tile of a chunk's rows at a time. It does where the kernel
is ready and, timed against SDPA when it loaded, was the quicker here
(`cpu_decode.CpuKernel.prefill_in_place`): SDPA's flash kernel multiplies on AMX tiles
where the CPU has them, and there it wins. Longer chunks, other devices, and the CPU
before the kernel is ready take SDPA (`sdpa_own_rows`, `sdpa_prefill`).

Given a `PrefillSlicing` (the forward's `models.slicing.LinearSlicer`) and a checkpoint
hook, the in-place runs attend in pieces of rows of nearly equal work (`split_run`),
the runs of fresh chunks in groups of chunks and the other chunks in even ranges of
rows, each piece timed for the slicer, with the hook between two pieces and after the
decode rows.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from typing import Protocol

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from .linear import empty_with_bucket_room

log = logging.getLogger(__name__)

#: torch's flash attention on the CPU runs chunks whose length is not a multiple of 16
#: at up to half speed (8 chunks of 254 tokens: 5.4-7.1 ms against 2.9 padded to 256,
#: AMX machine, 2 threads), so `sdpa_own_rows` pads them to one.
CPU_SDPA_LENGTH_MULTIPLE = 16
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
        return sum(_chunk_keys(start, end - begin) for start, begin, end in self.chunks())


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
        return self.count * _chunk_keys(0, self.length)


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


class PrefillSlicing(Protocol):
    """How many pieces a prefill's attention is cut into (`models.slicing`), told how
    long each piece took."""

    def attention_parts(self, path: str, keys: int) -> int: ...

    def attention_took(self, path: str, seconds: float, keys: int) -> None: ...


class PrefillPieces:
    """The pieces of one layer's prefill attention: how many (`parts`), and each one
    timed for `slicing`, with `between()` before every piece but the first (before the
    first too if `started`: something ran before it)."""

    def __init__(
        self,
        slicing: PrefillSlicing | None,
        between: Callable[[], None] | None,
        *,
        started: bool = False,
    ) -> None:
        self.slicing = slicing if between is not None else None
        self.between = between
        self.started = started

    def parts(self, path: str, keys: int) -> int:
        return 1 if self.slicing is None else max(1, self.slicing.attention_parts(path, keys))

    @contextlib.contextmanager
    def piece(self, path: str, keys: int) -> Iterator[None]:
        if self.started and self.between is not None:
            self.between()
        self.started = True
        started = time.perf_counter()
        yield
        if self.slicing is not None:
            self.slicing.attention_took(path, time.perf_counter() - started, keys)


def _even_cuts(count: int, parts: int) -> list[tuple[int, int]]:
    """`count` items in `parts` consecutive groups of nearly equal size."""
    parts = max(1, min(parts, count))
    cuts = [round(i * count / parts) for i in range(parts + 1)]
    return list(zip(cuts, cuts[1:], strict=False))


def _chunk_keys(start: int, length: int) -> int:
    """The keys `length` rows from position `start` attend causally, summed."""
    return length * start + length * (length + 1) // 2


def split_run(run: PrefillRun, parts: int) -> list[PrefillRun]:
    """`run` cut into up to `parts` consecutive runs of nearly equal work (keys
    attended). A cut may fall inside a chunk: its rows from there on are a chunk of
    their own whose first token is further on (every key of the step is in the cache
    before attention starts)."""
    if parts <= 1:
        return [run]
    chunks = run.chunks()
    first_rows = [begin for _, begin, _ in chunks]
    work = np.concatenate(
        [
            np.arange(start + 1, start + 1 + end - begin, dtype=np.int64)
            for start, begin, end in chunks
        ]
    ).cumsum()
    parts = min(parts, len(work))
    wanted = work[-1] * np.arange(1, parts) / parts
    cuts = sorted({0, *(np.searchsorted(work, wanted) + 1).tolist(), len(work)})
    pieces = []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        first = bisect.bisect_right(first_rows, lo) - 1
        last = bisect.bisect_left(first_rows, hi) - 1
        covered = chunks[first : last + 1]
        starts = [start + max(lo - begin, 0) for start, begin, _ in covered]
        offsets = [max(begin, lo) - lo for _, begin, _ in covered] + [hi - lo]
        pieces.append(
            PrefillRun(
                run.start + lo,
                run.start + hi,
                run.tables[first : last + 1],
                torch.tensor(starts, dtype=torch.int32, device=run.starts.device),
                torch.tensor(offsets, dtype=torch.int32, device=run.starts.device),
            )
        )
    return pieces


def padding_mask(context_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[batch, 1, 1, width] bool: True where a position is inside the context."""
    positions = torch.arange(width, device=context_lens.device)
    return (positions[None, :] < context_lens[:, None])[:, None, None, :]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    written: bool = False,
    slicing: PrefillSlicing | None = None,
    between: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Write `key`/`value` ([tokens, kv_heads, dim]) into the cache (unless `written`:
    the caller did, `fused.rope_and_cache`), then attend. With `slicing` and
    `between`, the prefill chunks attend in pieces of rows (`split_run`) or of chunks,
    as many as `slicing` says, with `between()` between two pieces.

    `query` is [tokens, heads, dim]; returns [tokens, heads * dim].
    """
    num_tokens, num_heads, head_dim = query.shape
    if not written:
        write_slots(key_cache, meta.slot_mapping, key)
        write_slots(value_cache, meta.slot_mapping, value)

    out = empty_with_bucket_room(
        num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device
    )
    decode = decode_backend(query.device.type)
    # after the decode rows, the prefill's first piece waits for a checkpoint too
    pieces = PrefillPieces(slicing, between, started=meta.num_decode > 0)
    if meta.num_decode:
        n = meta.num_decode
        assert meta.decode_tables is not None and meta.decode_context_lens is not None
        if decode is reference_decode:
            out[:n] = reference_decode(
                query[:n],
                key_cache,
                value_cache,
                meta.decode_tables,
                meta.decode_context_lens,
                scale,
                mask=meta.decode_mask,
            )
        else:
            out[:n] = decode(
                query[:n],
                key_cache,
                value_cache,
                meta.decode_tables,
                meta.decode_context_lens,
                scale,
            )
    prefills_in_place = getattr(decode, "prefills_in_place", None)
    in_place = prefills_in_place is not None and prefills_in_place(query.dtype)
    if in_place:
        for run in meta.prefill_runs:
            for part in split_run(run, pieces.parts("in place", run.keys)):
                rows = slice(part.start, part.end)
                with pieces.piece("in place", part.keys):
                    decode.prefill(  # type: ignore[attr-defined]
                        out[rows],
                        query[rows],
                        key_cache,
                        value_cache,
                        part.tables,
                        part.starts,
                        part.offsets,
                        scale,
                    )
    for fresh in meta.fresh_runs:
        if not (in_place and fresh.in_place):
            parts = min(fresh.count, pieces.parts("sdpa", fresh.keys))
            for lo, hi in _even_cuts(fresh.count, parts):
                rows = slice(fresh.start + lo * fresh.length, fresh.start + hi * fresh.length)
                with pieces.piece("sdpa", (hi - lo) * fresh.keys // fresh.count):
                    out[rows] = sdpa_own_rows(query[rows], key[rows], value[rows], hi - lo, scale)
    for span in meta.prefills:
        if span.mask is None or (in_place and span.in_place):
            continue
        length = span.end - span.start  # each row attends the whole gathered context
        parts = pieces.parts("sdpa masked", length * span.context_len)
        for lo, hi in _even_cuts(length, parts):
            rows = slice(span.start + lo, span.start + hi)
            with pieces.piece("sdpa masked", (hi - lo) * span.context_len):
                out[rows] = sdpa_prefill(
                    query[rows],
                    key_cache,
                    value_cache,
                    span.blocks,
                    span.context_len,
                    span.mask[lo:hi],
                    scale,
                )
    return out.view(num_tokens, num_heads * head_dim)


def sdpa_own_rows(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, count: int, scale: float
) -> torch.Tensor:
    """`count` chunks of one length laid out one after another (query [rows, heads,
    dim], key and value [rows, kv_heads, dim]), each attending causally over its own
    rows; returns [rows, heads, dim]. On the CPU a chunk is padded at its end to a
    multiple of `CPU_SDPA_LENGTH_MULTIPLE` tokens: under the causal mask only the
    padding rows see the padding keys, and they are dropped."""
    length = query.shape[0] // count
    padded = length
    if query.device.type == "cpu":
        padded = -(-length // CPU_SDPA_LENGTH_MULTIPLE) * CPU_SDPA_LENGTH_MULTIPLE

    def batched(x: torch.Tensor) -> torch.Tensor:  # [count, heads, padded, dim]
        rows = x.view(count, length, *x.shape[1:]).transpose(1, 2)
        if padded == length:
            return rows
        out = x.new_zeros(count, x.shape[1], padded, x.shape[2])
        out[:, :, :length] = rows
        return out

    attended = F.scaled_dot_product_attention(
        batched(query),
        batched(key),
        batched(value),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return attended[:, :, :length].transpose(1, 2).reshape(query.shape)


def sdpa_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    context_len: int,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One chunk's rows (query [n, heads, dim]) over its gathered `blocks`: causal from
    position 0 when `mask` is None, else as `mask` [n, context_len] says."""
    keys = _gather(key_cache, blocks[None])[..., :context_len, :]
    values = _gather(value_cache, blocks[None])[..., :context_len, :]
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),  # [1, heads, n, dim]
        keys,
        values,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return attended[0].transpose(0, 1)


DecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def reference_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention in torch: query [batch, heads, dim] over each row's blocks
    ([batch, max_blocks] ids, `context_lens` tokens); returns [batch, heads, dim].

    Two batched matrix multiplies with the query heads grouped under their KV head:
    for one query row, this is several times faster on the CPU than
    `scaled_dot_product_attention`, whose CPU kernels are built for long queries.
    Scores and softmax are in float32."""
    batch, heads, dim = query.shape
    keys = _gather_head_major(key_cache, block_tables)  # [kv_heads, batch, width, dim]
    values = _gather_head_major(value_cache, block_tables)
    kv_heads, _, width, _ = keys.shape
    grouped = query.view(batch, kv_heads, heads // kv_heads, dim).transpose(0, 1)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale  # [kvh, b, g, w]
    if mask is None:
        mask = padding_mask(context_lens, width)
    scores.masked_fill_(~mask.view(1, batch, 1, width), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).transpose(0, 1).reshape(batch, heads, dim)


def block_major_cache(device: torch.device) -> bool:
    """Whether the K/V cache on `device` is stored block-major ([blocks, slots, kv_heads,
    dim]) rather than head-major ([kv_heads, blocks, slots, dim]), for the kernels that
    will read it: block-major for Ascend's fused kernels, and on the CPU wherever the
    compiled library is expected, prebuilt or built here (its kernels take either; a
    step's scattered writes and the decode's block reads then touch one page for all
    of a slot's heads instead of one page per head: a decode step of 32 rows of the
    reference model ~12 % quicker, prefill the same); head-major for the torch reference, whose gather is one
    `index_select` per head there (block-major, 60 % slower), and for Triton."""
    if device.type == "npu":
        return True
    if device.type != "cpu" or os.environ.get("KVSCOPE_ATTENTION", "auto") == "reference":
        return False
    from .cpu_decode import library_expected

    return library_expected()


@cache
def decode_backend(device_type: str) -> DecodeFn:
    """The decode kernel for tensors on `device_type` (resolved once per type)."""
    if os.environ.get("KVSCOPE_ATTENTION", "auto") == "reference":
        return reference_decode
    if device_type == "cuda":
        try:
            from .triton_attention import paged_decode
        except ImportError as exc:
            log.warning("Triton is unavailable (%s); CUDA decode uses the torch reference", exc)
            return reference_decode
        return paged_decode
    if device_type == "npu":
        from .npu import NpuDecode

        return NpuDecode(fallback=reference_decode)
    if device_type == "cpu":
        from .cpu_decode import CpuDecode

        return CpuDecode(fallback=reference_decode)
    return reference_decode


def write_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Write `values` ([tokens, kv_heads, dim]) into flat cache `slots` of `cache`
    ([blocks, block_size, kv_heads, dim], head-major or block-major storage)."""
    num_blocks, block_size, heads, dim = cache.shape
    head_major = cache.permute(2, 0, 1, 3)
    if head_major.is_contiguous():
        head_major.view(heads, num_blocks * block_size, dim).index_copy_(
            1, slots, values.transpose(0, 1)
        )
    else:
        cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slots, values)


def _gather_head_major(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[batch, max_blocks] block ids -> [kv_heads, batch, max_blocks * block_size, dim].

    With the cache's head-major storage (see `KVCache`) this is one `index_select` into
    a contiguous result, laid out as the batched matrix multiplies want it."""
    batch, width = tables.shape
    num_blocks, block_size, heads, dim = cache.shape
    head_major = cache.permute(2, 0, 1, 3)
    if not head_major.is_contiguous():  # block-major storage: gather whole blocks, then
        # lay the heads out first (one copy; index_select from the permuted view is ~10x slower)
        blocks = cache.index_select(0, tables.reshape(-1))
        return blocks.permute(2, 0, 1, 3).reshape(heads, batch, width * block_size, dim)
    # index_select copies whole blocks ~3x faster from a 3-d view than a 4-d one.
    head_major = head_major.view(heads, num_blocks, block_size * dim)
    gathered = head_major.index_select(1, tables.reshape(-1))
    return gathered.view(heads, batch, width * block_size, dim)


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[batch, max_blocks] block ids -> [batch, kv_heads, max_blocks * block_size, dim]."""
    return _gather_head_major(cache, tables).transpose(0, 1)
