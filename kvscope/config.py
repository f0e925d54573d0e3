"""Engine configuration: one frozen attrs class with its defaults and validation.

`EngineConfig` is everything `Engine.open(**config)` accepts besides the model, device
and dtype. Values are validated on construction, so a bad setting is a `ValueError`
that names the field, before any model is loaded.
"""

from __future__ import annotations

import json

import attrs
from attrs import validators as v

from kvscope.params import MAX_LOGPROBS
from kvscope.scheduling import allowed_cores, listed_cores

_positive = v.gt(0)

#: Bytes of prompt allowed per token of context when `max_prompt_bytes` is None: more
#: than any real text needs (English averages about 4), far less than a flood.
PROMPT_BYTES_PER_TOKEN = 32


def lora_module(text: str) -> tuple[str, str]:
    """One `--lora-modules` value, as vLLM takes it: `name=path`, or a JSON object
    with `name` and `path` (its `base_model_name` is this server's model)."""
    if text.lstrip().startswith("{"):
        try:
            given = json.loads(text)
            return str(given["name"]), str(given["path"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"lora_modules: {text!r} is not a JSON object with name and path"
            ) from None
    name, equals, path = text.partition("=")
    if not equals or not path:
        raise ValueError(f"lora_modules: {text!r} is not NAME=PATH")
    return name, path


def _lora_modules(value: object) -> tuple[tuple[str, str], ...]:
    """(name, path) pairs from a dict or pairs; names unique and not empty."""
    pairs = list(value.items()) if isinstance(value, dict) else list(value)  # type: ignore[call-overload]
    modules = tuple((str(name), str(path)) for name, path in pairs)
    names = [name for name, _ in modules]
    if any(not name.strip() for name in names):
        raise ValueError("lora_modules: a LoRA adapter's name must not be empty")
    if len(set(names)) != len(names):
        raise ValueError("lora_modules: each LoRA adapter needs a name of its own")
    return modules


@attrs.frozen(kw_only=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `--speculative-config` JSON names it: each decode
    step of a row proposes up to `num_speculative_tokens` tokens by n-gram lookup (the
    last `prompt_lookup_max` down to `prompt_lookup_min` tokens matched earlier in the
    prompt and output) and verifies them in one forward (docs/speculative.md)."""

    method: str = attrs.field(default="ngram", validator=v.in_(("ngram",)))
    num_speculative_tokens: int = attrs.field(default=4, validator=[_positive, v.le(16)])
    prompt_lookup_max: int = attrs.field(default=4, validator=_positive)
    prompt_lookup_min: int = attrs.field(default=1, validator=_positive)
    #: With more requests running or waiting than this, steps run without speculation
    #: (a large batch's step is no longer bound by reading the weights). None: never.
    disable_by_batch_size: int | None = attrs.field(default=None, validator=v.optional(_positive))

    def __attrs_post_init__(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """From vLLM's JSON (a string or a dict), or an instance; None stays None. A key
        kvscope does not serve is refused, naming it."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"speculative_config: {value!r} is not JSON") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config: expected a JSON object")
        given = dict(value)
        if given.get("method") is None and "model" not in given:
            given["method"] = "ngram"
        if "model" in given or given.get("method") != "ngram":
            asked = f"draft model {given['model']!r}" if "model" in given else "method"
            raise ValueError(
                f"speculative_config: the {asked} {given.get('method') or ''} is not served; "
                "method 'ngram' (prompt lookup) is"
            )
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s): {', '.join(unknown)}")
        try:
            return cls(**given)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"speculative_config: {exc}") from None


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Cache, scheduler and runtime limits of one engine."""

    #: Token slots per KV block.
    block_size: int = attrs.field(default=16, validator=_positive)
    #: KV blocks in the pool; None sizes the pool to `kv_cache_tokens`.
    num_kv_blocks: int | None = attrs.field(default=None, validator=v.optional(_positive))
    #: Token slots to reserve when `num_kv_blocks` is None.
    kv_cache_tokens: int = attrs.field(default=65_536, validator=_positive)
    #: Longest sequence (prompt + output); None takes the model's own limit.
    max_model_len: int | None = attrs.field(default=None, validator=v.optional(_positive))
    #: Most sequences in one step.
    max_num_seqs: int = attrs.field(default=64, validator=_positive)
    #: Token budget of one step (decode tokens + prefill chunks). The checkpoint gap,
    #: not the step, bounds a cancel's wait; the step bounds how long a prompt that
    #: arrives during it waits. Served on the 2-core machine, 32 streams of 256-token
    #: prompts, alternating runs (docs/benchmarks/README.md, "Measured settings": a
    #: step budget of 1,536 tokens): 1,536 gave TTFT p50 206-242 ms and
    #: 1,541-1,639 tok/s in eight levels, against 236-298 ms and 1,524-1,599 tok/s with
    #: vLLM's CPU server default of 2,048 (four); 1,280 and 1,024 cut the p50 no further
    #: and raised the p90 (509-590 ms against 477-493).
    max_num_batched_tokens: int = attrs.field(default=1536, validator=_positive)
    #: Longest forward time, in seconds, that a step's prefill chunks may fill, from a
    #: cost per token learned from the step times (actors/step_budget.py); 0 bounds
    #: them by `max_num_batched_tokens` only.
    max_step_seconds: float = attrs.field(default=0.0, validator=v.ge(0.0))
    #: Fraction of the pool kept free when admitting new sequences.
    watermark: float = attrs.field(default=0.01, validator=[v.ge(0.0), v.lt(1.0)])
    #: Keep full blocks in an evictable prefix cache after their last user leaves.
    enable_prefix_caching: bool = True
    #: Longest stretch of forward, in seconds, meant to lie between two checkpoints
    #: (where a request cancelled mid-step leaves the batch and frees its KV blocks):
    #: long linear layers run in column pieces to keep it, on the CPU; 0 cuts nothing
    #: (checkpoints before each layer's attention and MLP only).
    checkpoint_gap: float = attrs.field(default=0.002, validator=v.ge(0.0))
    #: torch intra-op threads used by the model step (None: leave torch's setting).
    model_threads: int | None = attrs.field(default=None, validator=v.optional(_positive))
    #: Most sequences waiting for admission before `submit` refuses more (a request
    #: with `n` samples counts `n`).
    max_queued_requests: int = attrs.field(default=4096, validator=_positive)
    #: Largest prompt in UTF-8 bytes, checked before tokenizing; None allows
    #: PROMPT_BYTES_PER_TOKEN bytes per token of the model's context.
    max_prompt_bytes: int | None = attrs.field(default=None, validator=v.optional(_positive))
    #: Texts at least this many bytes long are tokenized (and chat templates rendered)
    #: in a worker thread, so that the event loop never waits on a big one.
    tokenize_in_thread_bytes: int = attrs.field(default=16_384, validator=v.ge(0))
    #: Finished requests kept for look-up by id (the oldest are forgotten first)...
    finished_history: int = attrs.field(default=10_000, validator=_positive)
    #: ...and the bytes they may hold: a kept request holds its summary, text and
    #: token ids (its per-token history is dropped when it ends).
    finished_history_bytes: int = attrs.field(default=64 << 20, validator=_positive)
    #: Longest parent chain: a request may have at most this many ancestors. Each level
    #: nests one more cancel scope, and cancellation is delivered through the nesting.
    max_request_depth: int = attrs.field(default=32, validator=v.ge(0))
    #: The most log-probabilities a request may ask for per token (`logprobs`,
    #: `prompt_logprobs`; -1 asks for the whole vocabulary), as vLLM's `--max-logprobs`;
    #: -1: no limit.
    max_logprobs: int = attrs.field(default=MAX_LOGPROBS, validator=v.ge(-1))
    #: Most live requests in one family (a root request and all its descendants, the
    #: `n` samples of one call included).
    max_family_size: int = attrs.field(default=256, validator=_positive)
    #: Share prefix-cache blocks only between requests of the same owner (API key), so
    #: that no key can time another's prompts (docs/security.md).
    isolate_prefix_cache: bool = True
    #: Path of the JSON-lines audit log; None keeps records in memory only.
    audit_log: str | None = None
    #: Check the block pool's integrity whenever the step actor idles.
    debug: bool = False
    #: Where the model's forward runs: "thread" (a worker thread of this process) or
    #: "process" (a model worker process, so the event loop never shares a GIL with it).
    worker: str = attrs.field(default="thread", validator=v.in_(("thread", "process")))
    #: The model worker process's nice value (0-19): where the model fills every core, a
    #: woken event loop then takes the CPU from the forward at once instead of waiting
    #: out its time slice (`bench cancel`, 2 model threads on 2 cores: the machine's
    #: wake-up p99 3.8 -> 0.75-1.45 ms, the loop lag p99 6.6-8.1 -> 4.7-4.9 ms). It costs
    #: throughput there: 32 streams took 6 percent longer (15.5 against 14.5 s, 4 runs
    #: each), the forward's threads being preempted more often. 0 shares the CPU evenly.
    worker_nice: int = attrs.field(default=10, validator=[v.ge(0), v.le(19)])
    #: The cores the model worker process keeps to: "auto" (where the model has fewer
    #: threads than this process has cores, the last ones, one a thread, leaving the
    #: others to the event loop), "all", or a comma-separated list such as "2,3".
    worker_cores: str = attrs.field(default="auto", validator=v.matches_re(r"auto|all|\d+(,\d+)*"))

    @worker_cores.validator
    def _cores_this_process_has(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in ("auto", "all"):
            listed_cores(value, allowed_cores())

    #: The name the model is served as (the OpenAI routes' `model`, `/v1/models`);
    #: None: its own (`bundled`, `tiny-random`, the checkpoint directory's name).
    served_model_name: str | None = attrs.field(
        default=None, validator=v.optional(v.matches_re(r"\S(.*\S)?"))
    )
    #: A Jinja chat template, or a file holding one, used in place of the checkpoint's
    #: (for a base model that has none, or to change it).
    chat_template: str | None = None
    #: Where the sampling defaults (temperature, top_p, top_k, min_p) come from, as
    #: vLLM's `--generation-config`: `auto` the checkpoint's generation_config.json,
    #: `vllm` none (kvscope's own defaults), or a directory holding a
    #: generation_config.json.
    generation_config: str = "auto"
    #: A JSON object of sampling defaults laid over those (vLLM's
    #: `--override-generation-config`), e.g. '{"temperature": 0.5}'.
    override_generation_config: str | None = None
    #: LoRA adapters requests may run with (`SamplingParams.lora`, the OpenAI routes'
    #: `model`), as vLLM's `--lora-modules`: (name, PEFT adapter directory) pairs, or a
    #: dict of them.
    lora_modules: tuple[tuple[str, str], ...] = attrs.field(
        default=(), converter=_lora_modules, metadata={"parse": lora_module, "nargs": "+"}
    )
    #: The largest LoRA rank an adapter may have (vLLM's `--max-lora-rank`); None: any.
    max_lora_rank: int | None = attrs.field(default=None, validator=v.optional(_positive))
    #: Seed for the random weights of `tiny-random` and for unseeded sampling.
    seed: int = 0
    #: What every generated request id starts with; a replica puts its own name in it
    #: so that an id says which replica owns it (kvscope.replicas).
    request_id_prefix: str = attrs.field(default="req-", validator=v.matches_re(r"[A-Za-z0-9_.-]+"))
    #: Speculative decoding, as vLLM's JSON says it: {"method": "ngram",
    #: "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m,
    #: "disable_by_batch_size": b} (default: off)
    speculative_config: SpeculativeConfig | None = attrs.field(
        default=None,
        converter=lambda value: SpeculativeConfig.parse(value),
        metadata={"parse": SpeculativeConfig.parse},
    )

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from keyword arguments, naming any that are unknown."""
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(unknown)}")
        return cls(**kwargs)  # type: ignore[arg-type]
