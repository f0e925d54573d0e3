"""The `transformers` peer of `bench throughput`: what a Python user would otherwise write.

Two ways, on the same checkpoint and the same prompt token ids as kvscope:
* one request at a time: `model.generate` per prompt, back to back;
* a static batch: every prompt of a level in one `generate` call (the prompts all have
  the same length, so the batch needs no padding; an attention mask is passed anyway).
Greedy, `min_new_tokens = max_new_tokens` (the `ignore_eos` of the others). The
checkpoint is the model, or `--peer-model` where the model is a GGUF file; `hf_phase`
runs both ways at every thread count.
"""

from __future__ import annotations

import argparse
import time

from ..core.options import ints
from ..core.workload import Workload, make_prompts
from .records import HfBatch, HfOneAtATime, HfRun

#: Why the peer does not run the reuse workload.
REUSE_SKIPPED = (
    "it runs the random workload only (the reuse workload's prompts differ in length, "
    "which a static batch would pad, and its speculation is not kvscope's or vLLM's)"
)


def available() -> str | None:
    """None if the peer can run, else why not."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install 'kvscope[bench]')"
    return None


def load(model_dir: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype, "auto")
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()


def _generate(model, prompts: list[list[int]], max_tokens: int) -> int:
    import torch

    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
        )
    return int(out.shape[0] * (out.shape[1] - ids.shape[1]))


def run_hf(
    model_dir: str,
    threads: int,
    sequential: Workload,
    batches: list[tuple[int, Workload]],
    *,
    dtype: str,
) -> HfRun:
    import torch

    torch.set_num_threads(threads)
    model = load(model_dir, dtype)
    _generate(model, [sequential.prompts[0]], 4)  # warm-up
    t0 = time.perf_counter()
    tokens = sum(_generate(model, [p], sequential.max_tokens) for p in sequential.prompts)
    wall = time.perf_counter() - t0
    one = HfOneAtATime(
        requests=sequential.num_requests,
        output_tokens=tokens,
        wall_s=round(wall, 3),
        tokens_per_s=round(tokens / wall, 1),
    )
    print(
        f"  transformers threads={threads} one at a time: {one.tokens_per_s:.0f} tok/s",
        flush=True,
    )
    static = []
    for size, workload in batches:
        t0 = time.perf_counter()
        tokens = _generate(model, workload.prompts[:size], workload.max_tokens)
        wall = time.perf_counter() - t0
        static.append(
            HfBatch(
                batch=size,
                output_tokens=tokens,
                wall_s=round(wall, 3),
                tokens_per_s=round(tokens / wall, 1),
            )
        )
        print(
            f"  transformers threads={threads} static batch {size}: {tokens / wall:.0f} tok/s",
            flush=True,
        )
    return HfRun(threads=threads, one_at_a_time=one, static_batch=static)


def hf_phase(
    args: argparse.Namespace, model: str | None, vocab: int, levels, missing: dict[str, str]
) -> list[HfRun]:
    why = (
        (None if args.workload == "random" else REUSE_SKIPPED)
        or available()
        or (None if model else f"transformers needs a checkpoint dir, not {args.model}")
        or (None if args.temperature == 0 else "its runs are greedy only (--temperature 0)")
    )
    if why:
        missing["transformers"] = why
        print(f"transformers peer MISSING: {why}", flush=True)
        return []
    assert model is not None  # else `why` says so
    prompts = make_prompts(args.hf_requests, args.prompt_tokens, vocab, seed=3)
    batches = [(c, w) for c, w in levels if c > 1]
    runs = []
    for threads in ints(args.threads):
        print(f"transformers, {threads} thread(s) ...", flush=True)
        one = Workload(prompts, args.max_tokens)
        runs.append(run_hf(model, threads, one, batches, dtype=args.dtype))
    return runs
