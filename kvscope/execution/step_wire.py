"""How a step and its answer cross the model worker's pipe: the wire format.

The engine sends each step's `StepInput` to the model worker process and reads back
the tokens drawn. Pickled as they are, a step of 32 decode rows cost ~150 µs on the
event loop and ~170 µs in the worker before its forward could start (each row's attrs
instances and its request's `SamplingParams`, ~30 fields, pickled anew every step), and
the answer's 32 `Sampled` instances ~40 µs more in the worker; as plain tuples, with
each request's parameters sent once, the step takes 12 and 16 µs and the answer a few
(measured on the 2-core benchmark machine). So:

* a row crosses as a tuple `(token_ids, start, block_table, sample, params key, state,
  prompt_targets, draft)`;
* `StepEncoder` (the engine's side, one per worker) gives each `SamplingParams` object
  a key and sends it with the first step that uses it; the worker's `StepDecoder` keeps
  it under that key. A key unused for `FORGET_AFTER` steps is forgotten on both sides
  (the step that says so carries its keys), and sent again if its request comes back,
  so the tables hold only what recent steps used. A new worker starts with an empty
  table, and the engine with a new encoder for it;
* the LoRA adapters' table (name -> directory) crosses as its changes: a step carries
  each adapter added or moved since the last (the worker reads it when a step first
  uses it) and each one removed (the worker frees it);
* a `torch.Generator` crosses as its state's bytes. A tensor (a generator's state is
  one) would cross by torch's storage sharing: a file descriptor handed over by
  multiprocessing's resource-sharer thread, with an HMAC handshake, per tensor per step
  (measured: most of the parent's GIL time in a step at 32 sampled rows); bytes are
  copied in the pickle;
* the answer is `("done", tokens, logprobs, states, prompt, embeddings, drafted)`: the
  token of each row (-1 for a row that drew none), the log-probabilities of the rows
  that have them by row, the generators' states, the prompt log-probabilities of the
  rows that scored their prompt tokens, the embeddings of `embed` rows (float32 bytes)
  and the accepted draft tokens of rows that verified one, by row; or `("aborted",)`
  or `("error", text)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvscope.kernels.sampling import Sampled
from kvscope.models.llama import StepAborted
from kvscope.params import SamplingParams

from .step_input import ChunkInput, StepInput

#: Steps after its last use when a request's parameters are forgotten by both sides.
FORGET_AFTER = 256
#: The encoder looks for keys to forget once every this many steps.
FORGET_EVERY = 64

Row = tuple[list[int], int, list[int], bool, int, Any, list[int], list[int]]
#: A step on the wire: rows, block copies, new parameters by key, keys to forget after
#: this step, the rows' generator states, and the LoRA adapters' changes.
StepMessage = tuple[
    list[Row],
    list[tuple[int, int]],
    dict[int, SamplingParams],
    list[int],
    list[bytes | None],
    dict[str, str | None],
]


class StepEncoder:
    """(the engine) Steps as `StepMessage`s for one worker, which holds the parameters
    sent so far."""

    def __init__(
        self, adapters: Mapping[str, str] | None = None, held: Mapping[str, str] | None = None
    ) -> None:
        #: The engine's LoRA adapters' table, and what the worker holds of it (it loaded
        #: `held` itself): a step carries the differences (`StepInput.adapters`).
        self._adapters = adapters if adapters is not None else {}
        self._adapters_held = dict(held or {})
        self._key_of: dict[int, int] = {}  # id(params) -> key, while `_sent` holds params
        self._sent: dict[int, tuple[SamplingParams, int]] = {}  # key -> (params, last step)
        self._next_key = 0
        self._steps = 0

    def encode(self, step: StepInput) -> StepMessage:
        self._steps += 1
        new: dict[int, SamplingParams] = {}
        rows: list[Row] = []
        for chunk in step.chunks:
            key = self._key(chunk.params, new)
            rows.append(
                (
                    chunk.token_ids,
                    chunk.start,
                    chunk.block_table,
                    chunk.sample,
                    key,
                    chunk.state,
                    chunk.prompt_targets,
                    chunk.draft,
                )
            )
        states = [_bytes(c.generator) if c.generator is not None else None for c in step.chunks]
        forget = self._forget() if self._steps % FORGET_EVERY == 0 else []
        changed = self._adapter_changes() if self._adapters != self._adapters_held else {}
        return rows, step.copies, new, forget, states, changed

    @property
    def held(self) -> int:
        """How many requests' parameters the worker holds now."""
        return len(self._sent)

    def _key(self, params: SamplingParams, new: dict[int, SamplingParams]) -> int:
        key = self._key_of.get(id(params))
        if key is None:
            key = self._key_of[id(params)] = self._next_key
            self._next_key += 1
            new[key] = params
        self._sent[key] = (params, self._steps)
        return key

    def _adapter_changes(self) -> dict[str, str | None]:
        table, held = self._adapters, self._adapters_held
        changed: dict[str, str | None] = {name: None for name in held if name not in table}
        changed |= {name: path for name, path in table.items() if held.get(name) != path}
        self._adapters_held = dict(table)
        return changed

    def _forget(self) -> list[int]:
        stale = [key for key, (_, last) in self._sent.items() if self._steps - last >= FORGET_AFTER]
        for key in stale:
            params, _ = self._sent.pop(key)
            del self._key_of[id(params)]
        return stale


class StepDecoder:
    """(the worker) `StepMessage`s back into `StepInput`s."""

    def __init__(self) -> None:
        self._params: dict[int, SamplingParams] = {}

    def decode(self, message: StepMessage) -> StepInput:
        rows, copies, new, forget, states, adapters = message
        self._params.update(new)
        chunks = [
            ChunkInput(
                ids, start, table, sample, self._params[key], _generator(raw), state, targets, draft
            )
            for (ids, start, table, sample, key, state, targets, draft), raw in zip(
                rows, states, strict=True
            )
        ]
        for key in forget:  # none of them is used by this step
            del self._params[key]
        return StepInput(chunks, copies, adapters)

    @property
    def held(self) -> int:
        """How many requests' parameters this worker holds now."""
        return len(self._params)


def encode_answer(tokens: list[Sampled | None], step: StepInput) -> tuple[Any, ...]:
    """(the worker) The answer to `step`: its tokens, log-probabilities and generators."""
    ids = [-1 if row is None or row.token is None else row.token for row in tokens]
    logprobs = {
        i: row.logprobs
        for i, row in enumerate(tokens)
        if row is not None and row.logprobs is not None
    }
    states = [_bytes(c.generator) if c.generator is not None else None for c in step.chunks]
    prompt = {i: row.prompt_logprobs for i, row in enumerate(tokens) if row and row.prompt_logprobs}
    embeddings = {i: row.embedding for i, row in enumerate(tokens) if row and row.embedding}
    drafted = {i: row.drafted for i, row in enumerate(tokens) if row and row.drafted}
    return "done", ids, logprobs, states, prompt, embeddings, drafted


def decode_answer(step: StepInput, message: Any) -> list[Sampled | None]:
    """(the engine) The tokens of the worker's answer to `step`; its generators take
    the states the worker's copies ended with, as if they had drawn here."""
    kind = message[0]
    if kind == "aborted":
        raise StepAborted
    if kind != "done":
        raise RuntimeError(f"model worker: {message[1]}")
    _, ids, logprobs, states, prompt, embeddings, drafted = message
    for chunk, state in zip(step.chunks, states, strict=True):
        if chunk.generator is not None and state is not None:
            chunk.generator.set_state(_tensor(state))
    return [
        None
        if token < 0 and i not in prompt and i not in embeddings
        else Sampled(
            None if token < 0 else token,
            logprobs.get(i),
            prompt.get(i, ()),
            embeddings.get(i),
            drafted.get(i, ()),
        )
        for i, token in enumerate(ids)
    ]


def _bytes(generator: torch.Generator) -> bytes:
    return generator.get_state().numpy().tobytes()


def _tensor(state: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def _generator(state: bytes | None) -> torch.Generator | None:
    if state is None:
        return None
    generator = torch.Generator()
    generator.set_state(_tensor(state))
    return generator
