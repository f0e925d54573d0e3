"""Everything the engine does on a bfloat16 model, on weights kept quantized: a tiny
llama checkpoint converted to a Q4_1 GGUF file (every matrix, the tied-off head too)
and served as the file is (`dtype="auto"`).

Steps are capped below `DOT_ROWS` rows, so every multiply takes the quantized decode
kernel, which computes each row on its own: a request's tokens then do not depend on
what shares its steps, and each test can hold a request batched beside others,
cancelled ones, a cache hit, a worker process or an adapter to its tokens alone. (In
bfloat16, dequantized or not, a prompt whose chunks start elsewhere, as after another
request's prefix, may round its attention otherwise: the cancelled requests' prompts
are their own.) Prefill chunks go through the compiled `paged_prefill`, whose rows do not
depend on where a chunk starts either: SDPA's, which wins the timing on an AMX CPU
(`kernels/prefill_choice.py`), tiles the keys by the chunk's end and rounds otherwise."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvscope import BeamSearchParams
from kvscope.beam_search import beam_search
from kvscope.kernels.quantized import DOT_ROWS

from .gguf_files import Q, convert_checkpoint
from .test_lora import adapters  # noqa: F401 (the fixture)
from .test_parity import prompts

pytestmark = pytest.mark.anyio

#: Steps of one KV block's rows (fewer than `DOT_ROWS`): a prompt's chunks then start
#: on block boundaries whether it is computed whole or after a prefix-cache hit.
STEP = {"max_num_batched_tokens": 4, "block_size": 4, "dtype": "auto"}


@pytest.fixture(autouse=True)
def _kernel_prefill(kernel_prefill: None) -> None:
    """Prefill through the compiled kernel, here and in a worker process (see above)."""


@pytest.fixture(scope="module")
def q41_file(checkpoints: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert STEP["max_num_batched_tokens"] <= DOT_ROWS  # (the premise above)
    path, _ = convert_checkpoint(
        checkpoints("llama"),
        tmp_path_factory.mktemp("quantized") / "llama-q4_1.gguf",
        arch="llama",
        qtype_of=lambda name: (
            Q.Q4_1 if name.endswith("proj.weight") or "lm_head" in name else Q.F32
        ),
    )
    return path


async def _alone(open_engine: Any, path: Path, ids: list[int], **options: Any) -> list[int]:
    async with open_engine(str(path), **STEP, **options) as engine:
        assert "quantized-Q4_1" in engine.loaded.model.linear_layout
        out = await engine.generate(ids, temperature=0, max_tokens=16, ignore_eos=True)
        return list(out.token_ids)


async def beside_cancellations(
    engine: Any, ids_list: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[str | None]]:
    """Greedy streams of `ids_list` beside two that are cancelled once decoding: each
    stream's tokens, and the cancelled ones' finish reasons."""
    victims = [
        await engine.submit(ids[::-1], temperature=0, max_tokens=500, ignore_eos=True)
        for ids in ids_list[:2]
    ]
    jobs = [
        await engine.submit(ids, temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for ids in ids_list
    ]
    for victim in victims:
        async for _delta in engine.watch(victim.id):
            break
        report = await engine.cancel(victim.id)
        assert report.found and report.blocks_released > 0
    done = [await job.wait() for job in jobs]
    cancelled = [await victim.wait() for victim in victims]
    return [list(c.token_ids) for c in done], [c.finish_reason for c in cancelled]


async def test_batched_beside_cancellations_as_alone(
    q41_file: Path, checkpoints: Any, open_engine: Any
) -> None:
    ids_list = prompts(checkpoints("llama"))
    expected = [await _alone(open_engine, q41_file, ids) for ids in ids_list]
    async with open_engine(str(q41_file), **STEP) as engine:
        tokens, reasons = await beside_cancellations(engine, ids_list, 16)
    assert reasons == ["cancelled", "cancelled"]
    assert tokens == expected


async def test_the_prefix_cache_and_the_worker_process(
    q41_file: Path, checkpoints: Any, open_engine: Any
) -> None:
    ids = prompts(checkpoints("llama"))[1]
    expected = await _alone(open_engine, q41_file, ids)
    async with open_engine(str(q41_file), **STEP, worker="process") as engine:
        first = await engine.generate(ids, temperature=0, max_tokens=16, ignore_eos=True)
        with anyio.fail_after(120):
            while not engine.stats()["worker_pid"]:  # the worker loads its own copy
                await anyio.sleep(0.05)
        again = await engine.generate(ids, temperature=0, max_tokens=16, ignore_eos=True)
    assert list(first.token_ids) == list(again.token_ids) == expected
    assert again.cached_tokens > 0


async def test_beams_guides_and_embeddings(
    q41_file: Path, checkpoints: Any, open_engine: Any
) -> None:
    ids = prompts(checkpoints("llama"))[0]
    async with open_engine(str(q41_file), **STEP) as engine:
        beams = await beam_search(engine, ids, BeamSearchParams(beam_width=3, max_tokens=6))
        picked = await engine.generate(ids, guided_choice=["alpha", "beta"], max_tokens=10)
        embedded = await engine.generate(ids, embed=True)
    assert len(beams) == 3 and all(b.cumulative_logprob is not None for b in beams)
    scores = [b.cumulative_logprob for b in beams]
    assert scores == sorted(scores, reverse=True) or len(set(len(b.token_ids) for b in beams)) > 1
    assert picked.text in ("alpha", "beta")
    assert embedded.embedding is not None
    assert math.isclose(math.fsum(v * v for v in embedded.embedding), 1.0, rel_tol=1e-3)


async def test_an_adapter_on_quantized_base_weights(
    q41_file: Path,
    checkpoints: Any,
    adapters: Any,  # noqa: F811 (the fixture)
    open_engine: Any,
) -> None:
    paths, _ = adapters("llama")
    ids = prompts(checkpoints("llama"))[2]
    base = await _alone(open_engine, q41_file, ids)
    async with open_engine(str(q41_file), **STEP, lora_modules=paths) as engine:
        jobs = [
            await engine.submit(ids, temperature=0, max_tokens=16, ignore_eos=True, lora=lora)
            for lora in (None, "every", "every")
        ]
        plain, adapted, again = [list((await job.wait()).token_ids) for job in jobs]
    assert plain == base
    assert adapted == again != base
