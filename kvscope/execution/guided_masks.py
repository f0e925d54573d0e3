"""Guided rows sent to a model worker process: a guided row's grammar state stays in the
parent. The step thread (such a step is not sent from the loop) computes the row's token
mask before sending the step (`masks_for_worker`; `MaskOnly` carries it in the grammar's
place), and tells the grammar the token drawn when the step is done."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from .step_input import ChunkInput, StepInput


@attrs.frozen
class MaskOnly:
    """(worker) A guided row's token mask, computed by the parent's grammar; the parent
    tells its grammar the token drawn, so accepting here does nothing."""

    mask: torch.Tensor | None

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        return self.mask

    def accept(self, token: int) -> None:
        pass


def guide_to_mask(chunk: ChunkInput) -> Any:
    """The grammar whose mask this chunk's row needs this step, if any (it samples)."""
    guide = chunk.state.guide if chunk.state is not None else None
    return guide if chunk.sample else None


def masks_for_worker(step: StepInput, vocab_size: int) -> tuple[StepInput, list[tuple[int, Any]]]:
    """`step` with each guided row's grammar replaced by its mask for this step, and the
    (chunk, grammar) pairs to tell the tokens drawn."""
    guided = []
    chunks = list(step.chunks)
    for index, chunk in enumerate(chunks):
        guide = guide_to_mask(chunk)
        if guide is None:
            continue
        guided.append((index, guide))
        assert chunk.state is not None  # it has a guide
        # MaskOnly stands in for the grammar with what the forward uses (allowed, accept)
        mask = MaskOnly(guide.allowed(vocab_size))
        state = attrs.evolve(chunk.state, guide=mask)  # type: ignore[arg-type]
        chunks[index] = attrs.evolve(chunk, state=state)
    return (attrs.evolve(step, chunks=chunks) if guided else step), guided
