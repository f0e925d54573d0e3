"""Admission: whether a `RequestSpec` may become a request, and its `RequestState`s.

It owns the engine's limits on one request (the context, `max_prompt_bytes`, the
queue, a family's depth and size): whether a prompt and its `max_tokens` fit the
context is decided here only (`fit`, under the request's `ContextPolicy`), tokenizing (off the loop when the text is big),
the sampling parameters a request ends up with (the checkpoint's generation defaults
under the caller's, checked against the vocabulary and the structured-output
compiler), and building the states of a request and its samples. `prepare` is the
part that awaits (tokenizing); `admit` is synchronous, so its checks and the counts
they guard cannot interleave with another request's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections.abc import Callable
from typing import TypeVar

import anyio
import attrs
from anyio.abc import TaskGroup

from kvscope.config import PROMPT_BYTES_PER_TOKEN, EngineConfig
from kvscope.errors import EngineOverloaded, InvalidRequest, RequestConflict, UnknownRequest
from kvscope.kernels.guided import GuideCompiler
from kvscope.kernels.sampling import make_generator
from kvscope.models.loader import LoadedModel
from kvscope.params import ContextPolicy, SamplingParams
from kvscope.text import utf8_size

from .lifecycle import Ledger
from .registry import Registry, new_request_id
from .request import RequestState
from .scheduler import Scheduler
from .spec import Prompt, RequestSpec

T = TypeVar("T")


class Admission:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        scheduler: Scheduler,
        registry: Registry,
        ledger: Ledger,
        adapters: dict[str, str],
    ) -> None:
        self.loaded = loaded
        self.config = config
        self.adapters = adapters  # the engine's table of LoRA adapters
        self.tokenizer = loaded.tokenizer
        self.guides = GuideCompiler(self.tokenizer, loaded.config.vocab_size)
        self.scheduler = scheduler
        self.registry = registry
        self.ledger = ledger
        self._rng = random.Random(config.seed)
        # One sequence must always fit in the pool beside the watermark, or it could
        # never finish; cap the context to what the pool holds.
        num_blocks = scheduler.pool.num_blocks
        fits = (num_blocks - scheduler.watermark_blocks) * config.block_size
        if fits <= 0:
            raise InvalidRequest(
                f"a pool of {num_blocks} KV blocks leaves no room beside its watermark"
            )
        positions = loaded.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or positions, positions, fits)
        self.max_prompt_bytes = config.max_prompt_bytes or (
            PROMPT_BYTES_PER_TOKEN * self.max_model_len
        )
        # Tokenizing has its own threads: a flood of big prompts must never hold up the
        # step actor's thread (which takes the default limiter's).
        self._tokenize_limiter = anyio.CapacityLimiter(2)

    # -- the part that awaits -------------------------------------------------------------

    async def prepare(self, spec: RequestSpec) -> tuple[SamplingParams, list[int]]:
        """The request's sampling parameters and prompt tokens. A new grammar compiles
        in a thread (up to the compile deadline of `kernels/guide_limits.py`): the event
        loop goes on meanwhile; a compiled one comes from the compiler's cache."""
        params = self.sampling_params(spec)
        if params.guided:  # InvalidRequest about the guide's field if it cannot compile
            await anyio.to_thread.run_sync(self.guides.check, params)
        return params, await self.encode(spec.prompt)

    async def encode_text(
        self, text: str, *, add_special_tokens: bool = True, field: str = "prompt"
    ) -> list[int]:
        """Tokenize a client's text, which the request's `field` holds: valid Unicode and
        at most `max_prompt_bytes` (checked before tokenizing), and off the event loop
        when it is big."""
        what = f"the {field}"
        size = utf8_size(text, what, field=field)
        if size > self.max_prompt_bytes:
            raise InvalidRequest(
                f"{what} has {size} bytes; the limit (max_prompt_bytes) is {self.max_prompt_bytes}",
                field=field,
            )
        encode = functools.partial(self.tokenizer.encode, text, add_special_tokens)
        return await self.run_off_loop(size, encode)

    async def run_off_loop(self, size: int, work: Callable[[], T]) -> T:
        """Run `work` (tokenizing, rendering a chat) in a tokenizer thread when `size`
        (its input's bytes) is at least `tokenize_in_thread_bytes`, else here."""
        if size < self.config.tokenize_in_thread_bytes:
            return work()
        return await anyio.to_thread.run_sync(work, limiter=self._tokenize_limiter)

    async def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids; an `InvalidRequest` about the `prompt` if it has none,
        holds more than the context, or names a token outside the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty", field="prompt")
            return await self.encode_text(prompt)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequest("the prompt is empty", field="prompt")
            if len(prompt) > self.max_model_len:
                raise self._overflow(len(prompt))
            vocab = self.loaded.config.vocab_size
            for token in prompt:
                if isinstance(token, bool) or not isinstance(token, int):
                    raise InvalidRequest(
                        f"prompt token ids must be integers in [0, {vocab})", field="prompt"
                    )
                if not 0 <= token < vocab:  # vLLM's words first
                    raise InvalidRequest(
                        f"Token id {token} is out of vocabulary: prompt token ids must be "
                        f"integers in [0, {vocab})",
                        field="prompt",
                    )
            return list(prompt)
        raise InvalidRequest("the prompt must be a string or a list of token ids", field="prompt")

    def sampling_params(self, spec: RequestSpec) -> SamplingParams:
        sampling = dict(spec.sampling)
        try:
            if spec.params is None:
                # The checkpoint's generation_config.json supplies what the caller left out.
                params = SamplingParams(**{**self.loaded.generation_defaults, **sampling})
            elif sampling:
                params = attrs.evolve(spec.params, **sampling)
            else:
                params = spec.params
            params.check_vocab(self.loaded.config.vocab_size, self.config.max_logprobs)
        except InvalidRequest:
            raise  # about the field it names
        except (TypeError, ValueError) as exc:
            message, field = _about(exc)
            raise InvalidRequest(message, field=field) from None
        self._check_adapter(params)
        differ = self.loaded.embeddings_differ
        if params.embed and differ is not None:
            raise InvalidRequest(
                f"model {self.loaded.name!r} does not embed as kvscope does (the last "
                f"token's hidden state): {differ}"
            )
        if not params.embed and not self.loaded.generates:
            raise InvalidRequest(
                f"model {self.loaded.name!r} has no output head (an embedding model): it "
                "answers embeddings only (POST /v1/embeddings, or embed=True)"
            )
        return params

    def _check_adapter(self, params: SamplingParams) -> None:
        if params.lora is not None and params.lora not in self.adapters:
            loaded = ", ".join(repr(name) for name in self.adapters) or "none"
            raise InvalidRequest(
                f"lora: no LoRA adapter {params.lora!r} is loaded (loaded: {loaded})",
                field="lora",
            )

    # -- the synchronous part -------------------------------------------------------------

    def admit(
        self, spec: RequestSpec, params: SamplingParams, prompt_ids: list[int], root: TaskGroup
    ) -> tuple[RequestState, TaskGroup]:
        """Check the limits and build the request's state (its samples as its pending
        children); returns it and the task group its task joins. Counts its sequences
        as admitting until their tasks queue them."""
        params = self._fitted(params, len(prompt_ids), spec.context)
        self._check_adapter(params)  # again: one may have been unloaded since `prepare`
        queued = self.scheduler.num_waiting + self.ledger.admitting
        if queued + spec.samples > self.config.max_queued_requests:
            raise EngineOverloaded(
                f"{queued} sequences are already queued; the limit (max_queued_requests) "
                f"is {self.config.max_queued_requests}"
            )
        if spec.request_id is not None and spec.request_id in self.registry:
            raise RequestConflict(f"request id {spec.request_id!r} is already in use")
        parent, group = self._parent(spec, root)
        self._check_family(parent, spec.samples)
        state = self._new_state(spec, spec.request_id, prompt_ids, params, parent)
        for index in range(1, spec.samples):
            # Sample i's seed is seed + i, wrapped to stay a signed 64-bit integer.
            seed = None if params.seed is None else (params.seed + index + 2**63) % 2**64 - 2**63
            sample = attrs.evolve(params, seed=seed)
            state.pending_children.append(self._new_state(spec, None, prompt_ids, sample, state))
        self.ledger.admitting += spec.samples
        if spec.request_id is not None:
            self.registry.reserve(spec.request_id)  # until its task adds it
        return state, group

    def fit(self, prompt_len: int, max_tokens: int, context: ContextPolicy = "cap") -> int:
        """The `max_tokens` a completion after `prompt_len` prompt tokens runs with:
        `max_tokens` where both fit the context; else what fits under "cap", and under
        "refuse" an `InvalidRequest` about `max_tokens` naming both numbers (OpenAI's
        words, as vLLM's). A prompt that leaves no room is refused either way."""
        limit = self.max_model_len
        room = limit - prompt_len
        if room <= 0:
            raise self._overflow(prompt_len)
        if max_tokens <= room:
            return max_tokens
        if context == "cap":  # generate to the context's end, as asked
            return room
        raise InvalidRequest(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for "
            "the completion). Please reduce the length of the prompt or of max_tokens.",
            field="max_tokens",
        )

    def _fitted(
        self, params: SamplingParams, prompt_len: int, context: ContextPolicy
    ) -> SamplingParams:
        """`params` with a `max_tokens` that fits the context (`fit`); an embedding
        needs no room, and `min_tokens` must fit."""
        if params.embed:
            if prompt_len > self.max_model_len:
                raise self._overflow(prompt_len, completes=False)
            return params
        max_tokens = self.fit(prompt_len, params.max_tokens, context)
        if params.min_tokens > max_tokens:
            raise InvalidRequest(
                f"min_tokens is {params.min_tokens}, but the context ({self.max_model_len} "
                f"tokens) leaves {max_tokens} after the prompt's {prompt_len}",
                field="min_tokens",
            )
        return (
            attrs.evolve(params, max_tokens=max_tokens)
            if max_tokens != params.max_tokens
            else params
        )

    def _overflow(self, prompt_len: int, *, completes: bool = True) -> InvalidRequest:
        """The refusal of a prompt that leaves the completion no room (OpenAI's words)."""
        end = ", leaving none for the completion." if completes else "."
        return InvalidRequest(
            f"This model's maximum context length is {self.max_model_len} tokens; the "
            f"prompt has {prompt_len} tokens{end}",
            field="prompt",
        )

    def unadmit(self, state: RequestState, samples: int) -> None:
        """Its task could not start (its parent's group closed meanwhile)."""
        state.root.family_size -= samples
        if state.params.lora is not None:
            self.ledger.adapter_users[state.params.lora] -= samples
        self.ledger.admitting -= samples
        self.registry.unreserve(state.id)

    def _parent(self, spec: RequestSpec, root: TaskGroup) -> tuple[RequestState | None, TaskGroup]:
        if spec.parent is None:
            return None, root
        parent = self.registry.get(spec.parent)
        if parent is None or (spec.owner is not None and parent.owner != spec.owner):
            raise UnknownRequest(f"no parent request {spec.parent!r}")
        if parent.children_group is None or parent.cancel_requested():
            raise RequestConflict(f"parent request {spec.parent!r} has ended")
        return parent, parent.children_group

    def _check_family(self, parent: RequestState | None, samples: int) -> None:
        """Refuse a request that would make its parent chain or its family too big:
        every level of the chain nests one more cancel scope, and cancelling a family
        reaches each member."""
        config = self.config
        depth = parent.depth + 1 if parent is not None else 0
        if depth > config.max_request_depth:
            raise InvalidRequest(
                f"the parent chain is too deep: this request would have {depth} ancestors; "
                f"the limit (max_request_depth) is {config.max_request_depth}"
            )
        if samples > config.max_family_size:
            raise InvalidRequest(
                f"{samples} samples exceed the limit on one family's size "
                f"(max_family_size) of {config.max_family_size}"
            )
        if parent is not None and parent.root.family_size + samples > config.max_family_size:
            raise EngineOverloaded(
                f"the family of {parent.root.id!r} already has {parent.root.family_size} "
                f"live requests; the limit (max_family_size) is {config.max_family_size}"
            )

    def _new_state(
        self,
        spec: RequestSpec,
        request_id: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        parent: RequestState | None,
    ) -> RequestState:
        state = RequestState(
            request_id=request_id or new_request_id(self.config.request_id_prefix),
            prompt_ids=prompt_ids,
            params=params,
            tokenizer=self.tokenizer,
            priority=spec.priority,
            parent=parent,
            owner=spec.owner,
            timeout=spec.timeout,
            guide=self.guides.guide(params),
        )
        state.root.family_size += 1  # until its task ends
        if params.lora is not None:
            self.ledger.adapter_users[params.lora] += 1  # until its task ends
        owner = spec.owner if self.config.isolate_prefix_cache else None
        state.seq.cache_salt = cache_salt(owner, params.lora)
        if not params.greedy:
            state.seq.generator = make_generator(params.seed, self._rng.getrandbits(63))
        return state


def _about(exc: Exception) -> tuple[str, str | None]:
    """A `SamplingParams` error's message and, from an attrs type validator's error
    (`TypeError(message, attribute, type, value)`), the field it is about."""
    attribute = exc.args[1] if len(exc.args) == 4 else None
    if isinstance(attribute, attrs.Attribute) and isinstance(exc.args[0], str):
        return exc.args[0], attribute.name
    return str(exc), None


def cache_salt(owner: str | None, lora: str | None) -> bytes | None:
    """What starts a request's chain of block hashes: only requests with the same
    salt share cached blocks. The API key's owner, where the prefix cache is kept
    per key (docs/security.md), and the LoRA adapter, whose K/V differ from the
    base model's; None for the base model's shared cache."""
    if owner is None and lora is None:
        return None
    return hashlib.blake2b(json.dumps([owner, lora]).encode(), digest_size=16).digest()
