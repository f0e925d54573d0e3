"""Paged attention: writes new K/V into the paged cache through a slot mapping, then
attends each query over its sequence's blocks.

A step's tokens are laid out flat: first one token for each decoding sequence, then the
prefill chunks one after another. `AttentionMetadata` (`attention_metadata.py`) is built
once per step (not once per layer) and says where each goes:

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

The decode rows go through `decode_backend(device)` (`attention_backend.py`: the
compiled kernel of the device, or the torch reference, `reference.reference_decode`).
This module's names for the metadata, the backend and the references are the ones the
model and the tests use.

On the CPU, a prefill chunk whose context (the tokens before it and its own) is at
most `IN_PLACE_PREFILL_CONTEXT` may go through the compiled kernel's `paged_prefill`
instead (`PrefillRun`, built once per step: consecutive such chunks in one call), which
reads the blocks in place, a tile of a chunk's rows at a time. It does where the kernel
is ready and, timed against SDPA when it loaded, was the quicker here
(`cpu_decode.CpuKernel.prefill_in_place`): SDPA's flash kernel multiplies on AMX tiles
where the CPU has them, and there it wins. Longer chunks, other devices, and the CPU
before the kernel is ready take SDPA (`reference.sdpa_own_rows`, `sdpa_prefill`).

Given a `PrefillSlicing` (`kernels.attention_slicing.AttentionSlicer`) and a checkpoint
hook, the in-place runs attend in pieces of rows of nearly equal work (`split_run`),
the runs of fresh chunks in groups of chunks and the other chunks in even ranges of
rows, each piece timed for the slicer, with the hook between two pieces and after the
decode rows.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
import torch

from .attention_backend import block_major_cache, decode_backend
from .attention_metadata import (
    IN_PLACE_PREFILL_CONTEXT,
    AttentionMetadata,
    FreshRun,
    PrefillRun,
    PrefillSpan,
    build_metadata,
)
from .linear import empty_with_bucket_room
from .reference import (
    DecodeFn,
    padding_mask,
    reference_decode,
    sdpa_own_rows,
    sdpa_prefill,
    write_slots,
)

#: The names other modules reach through `attention`: metadata, backend, references.
__all__ = [
    "IN_PLACE_PREFILL_CONTEXT",
    "AttentionMetadata",
    "DecodeFn",
    "FreshRun",
    "PrefillPieces",
    "PrefillRun",
    "PrefillSlicing",
    "PrefillSpan",
    "block_major_cache",
    "build_metadata",
    "decode_backend",
    "padding_mask",
    "paged_attention",
    "reference_decode",
    "sdpa_own_rows",
    "sdpa_prefill",
    "split_run",
    "write_slots",
]


class PrefillSlicing(Protocol):
    """How many pieces a prefill's attention is cut into (`kernels.attention_slicing`),
    told how long each piece took."""

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
        _attend_decode(decode, out, query, key_cache, value_cache, meta, scale)
    prefills_in_place = getattr(decode, "prefills_in_place", None)
    in_place = prefills_in_place is not None and prefills_in_place(query.dtype)
    if in_place:
        _attend_in_place(decode, out, query, key_cache, value_cache, meta, scale, pieces)
    for fresh in meta.fresh_runs:
        if not (in_place and fresh.in_place):
            _attend_fresh(fresh, out, query, key, value, scale, pieces)
    for span in meta.prefills:
        if span.mask is None or (in_place and span.in_place):
            continue
        _attend_masked(span, out, query, key_cache, value_cache, scale, pieces)
    return out.view(num_tokens, num_heads * head_dim)


def _attend_decode(
    decode: DecodeFn,
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> None:
    """The decode rows `[0, num_decode)`, through the device's decode kernel."""
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


def _attend_in_place(
    decode: DecodeFn,
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    pieces: PrefillPieces,
) -> None:
    """The `PrefillRun`s, through the compiled kernel that reads the blocks in place."""
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


def _attend_fresh(
    fresh: FreshRun,
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    pieces: PrefillPieces,
) -> None:
    """A run of chunks that start their sequences: SDPA over their own rows, in groups
    of chunks."""
    parts = min(fresh.count, pieces.parts("sdpa", fresh.keys))
    for lo, hi in _even_cuts(fresh.count, parts):
        rows = slice(fresh.start + lo * fresh.length, fresh.start + hi * fresh.length)
        with pieces.piece("sdpa", (hi - lo) * fresh.keys // fresh.count):
            out[rows] = sdpa_own_rows(query[rows], key[rows], value[rows], hi - lo, scale)


def _attend_masked(
    span: PrefillSpan,
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    pieces: PrefillPieces,
) -> None:
    """A chunk with tokens before it in the cache: SDPA over its gathered blocks with
    its shifted causal mask, in even ranges of rows."""
    assert span.mask is not None
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
