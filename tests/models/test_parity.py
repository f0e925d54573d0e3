"""Parity with Hugging Face `transformers` on tiny random checkpoints of every
architecture: prefill logits (one-shot, chunked, and batched with decode rows) within
1e-4 relative in float32, and greedy tokens identical to `generate` when run alone,
batched with others, beside cancelled requests, through chunked prefill and through a
prefix-cache hit; prompt log-probabilities equal to `transformers`' log-softmax.
bfloat16 loads and runs. The tests with decode rows run twice: on the compiled CPU
library (decode attention, the fused elementwise steps, the rotary embedding with its
cache write) and on torch's ops alone.
"""

from __future__ import annotations

import functools
from typing import Any

import anyio
import pytest
import torch

from kvscope.cache.kv_cache import KVCache
from kvscope.kernels.attention import block_major_cache, build_metadata
from kvscope.kernels.slicing import LinearSlicer
from kvscope.models.loader import load_model
from kvscope.models.lora import LoraRows

CPU = torch.device("cpu")
NEW_TOKENS = 32

TEXTS = [
    "Once upon a time there was a small model",
    "The quick brown fox jumps over the lazy dog. Python is a programming language",
    "A cache of keys and values",
    "She sells sea shells by the sea shore, and in the beginning the universe was created.",
]


def prompts(checkpoint: Any) -> list[list[int]]:
    loaded = load_model(str(checkpoint), device=CPU, dtype="float32")
    return [loaded.tokenizer.encode(text) for text in TEXTS]


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf: Any, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=2,
        )
    return out[0, len(ids) :].tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4) -> None:
    error = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert error <= rtol, f"max error {error:.2e} relative to the largest logit"


class Cache:
    """A KV cache and block allocator for driving the model's forward by hand."""

    def __init__(self, loaded: Any, block_size: int = 4, num_blocks: int = 64) -> None:
        c = loaded.config
        self.model = loaded.model
        self.block_size = block_size
        self.kv = KVCache(
            num_layers=c.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            dtype=loaded.model.dtype,
            device=CPU,
            block_major=block_major_cache(CPU),
        )
        # Hand out blocks in a scrambled order so that a table is not just 0, 1, 2, ...
        self._free = [b for b in range(num_blocks - 1, 0, -1) if b % 3] + [
            b for b in range(num_blocks) if not b % 3
        ]
        self.tables: dict[int, list[int]] = {}

    def step(
        self,
        chunks: list[tuple[int, list[int], int]],
        slicer: LinearSlicer | None = None,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """Run chunks (sequence, token ids, start), one-token chunks first; all logits
        (with `slicer`, every linear layer in column pieces; with `lora`, the rows it
        names run with their LoRA adapters)."""
        for seq, ids, start in chunks:
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < start + len(ids):
                table.append(self._free.pop())
        meta = build_metadata(
            starts=[start for _, _, start in chunks],
            lengths=[len(ids) for _, ids, _ in chunks],
            block_tables=[self.tables[seq] for seq, _, _ in chunks],
            block_size=self.block_size,
            device=CPU,
        )
        input_ids = torch.tensor([t for _, ids, _ in chunks for t in ids])
        positions = torch.tensor([p for _, ids, s in chunks for p in range(s, s + len(ids))])
        hook = None if slicer is None else (lambda batch: None)
        with torch.inference_mode():
            hidden = self.model.forward(input_ids, positions, meta, self.kv, hook, slicer, lora)
            return self.model.logits(hidden, hook, slicer)


def test_prefill_logits_match_transformers(checkpoints: Any, kind: str) -> None:
    directory, hf = checkpoints(kind), checkpoints.hf_model(kind)
    loaded = load_model(str(directory), device=CPU, dtype="float32")
    for ids in prompts(directory):
        cache = Cache(loaded)
        assert_close(cache.step([(0, ids, 0)]), hf_logits(hf, ids))


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "linears-in-pieces"])
def test_chunked_and_batched_logits_match_transformers(
    checkpoints: Any, kind: str, attention_path: str, pieces: bool
) -> None:
    """Prefill in chunks of 5 tokens, while two other sequences decode in the same steps
    (their attention on the compiled kernel and on the fallback); and again with every
    linear layer cut into as many column pieces as it allows."""
    directory, hf = checkpoints(kind), checkpoints.hf_model(kind)
    loaded = load_model(str(directory), device=CPU, dtype="float32")
    a, b, c, _ = prompts(directory)
    cache = Cache(loaded)
    slicer = LinearSlicer(target=1e-12, min_columns=64) if pieces else None
    if slicer is not None:
        assert slicer.pieces(loaded.model.layers[0].gate_up, 1) > 1
    step = functools.partial(cache.step, slicer=slicer)
    step([(1, b, 0), (2, c, 0)])  # two sequences prefilled in one step
    ref_b, ref_c = hf_logits(hf, b + a[:6]), hf_logits(hf, c + a[:6])
    ours = []
    for start in range(0, len(a), 5):
        n = start // 5
        decode = [(1, [a[n]], len(b) + n), (2, [a[n]], len(c) + n)] if n < 6 else []
        logits = step([*decode, (0, a[start : start + 5], start)])
        if decode:
            assert_close(logits[0], ref_b[len(b) + n])
            assert_close(logits[1], ref_c[len(c) + n])
        ours.append(logits[len(decode) :])
    assert_close(torch.cat(ours), hf_logits(hf, a))


def test_long_prompts_in_pieces_of_rows_match_transformers(
    checkpoints: Any, kind: str, attention_path: str
) -> None:
    """Two fresh prompts of 160 tokens in one step, with the slicer at its finest:
    every linear layer cut by rows as well as columns, and the attention of the prompts
    in pieces (of rows, or a prompt a piece), which a first step taught it to time."""
    directory, hf = checkpoints(kind), checkpoints.hf_model(kind)
    loaded = load_model(str(directory), device=CPU, dtype="float32")
    tokens = [t for ids in prompts(directory) for t in ids] * 8
    first, second = tokens[:160], tokens[7:167]
    cache = Cache(loaded, num_blocks=128)
    slicer = LinearSlicer(target=1e-12, min_columns=64)
    assert len(slicer.cut(loaded.model.layers[0].gate_up, 320)[1]) > 1
    cache.step([(2, tokens[:40], 0)], slicer=slicer)  # the attention's first piece: timed
    logits = cache.step([(0, first, 0), (1, second, 0)], slicer=slicer)
    assert_close(logits[:160], hf_logits(hf, first))
    assert_close(logits[160:], hf_logits(hf, second))


async def generate_all(
    open_engine: Any, checkpoint: Any, ids_list: list[list[int]], **config: Any
) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in ids_list]
    async with open_engine(str(checkpoint), dtype="float32", **config) as engine:
        async with anyio.create_task_group() as tg:
            for i, ids in enumerate(ids_list):

                async def one(i: int = i, ids: list[int] = ids) -> None:
                    out = await engine.generate(
                        ids, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True
                    )
                    results[i] = list(out.token_ids)

                tg.start_soon(one)
    return results


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_greedy_alone_matches_generate(checkpoints: Any, kind: str, open_engine: Any) -> None:
    directory, hf = checkpoints(kind), checkpoints.hf_model(kind)
    for ids in prompts(directory)[:2]:
        assert await generate_all(open_engine, directory, [ids]) == [hf_greedy(hf, ids)]


@pytest.mark.anyio
async def test_greedy_batched_with_cancellations_matches_generate(
    checkpoints: Any, kind: str, open_engine: Any, attention_path: str
) -> None:
    """All prompts at once, beside four requests cancelled part-way; the survivors'
    tokens are exactly what `generate` gives each prompt alone."""
    directory, hf = checkpoints(kind), checkpoints.hf_model(kind)
    ids_list = prompts(directory)
    expected = [hf_greedy(hf, ids) for ids in ids_list]
    batch_sizes: list[int] = []
    async with open_engine(str(directory), dtype="float32", block_size=4) as engine:
        engine.step_listeners.append(lambda _start, _secs, size: batch_sizes.append(size))
        victims = [
            await engine.submit(
                ids[: 3 + i] + [7] * i, temperature=0, max_tokens=200, ignore_eos=True
            )
            for i, ids in enumerate(ids_list)
        ]
        jobs = [
            await engine.submit(ids, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            for ids in ids_list
        ]
        for n, victim in enumerate(victims):
            # Cancel each victim once it has produced a few tokens (a different count each).
            async for _delta in engine.watch(victim.id):
                info = engine.get(victim.id)
                if info is not None and info.tokens_generated >= 2 + 3 * n:
                    break
            report = await engine.cancel(victim.id)
            assert report.found
        done = [await job.wait() for job in jobs]
        cancelled = [await victim.wait() for victim in victims]
    assert [list(c.token_ids) for c in done] == expected
    assert all(c.finish_reason == "cancelled" for c in cancelled)
    assert max(batch_sizes) >= len(ids_list) + 2, batch_sizes


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_chunked_prefill_gives_the_same_tokens(
    checkpoints: Any, kind: str, open_engine: Any
) -> None:
    directory, hf = checkpoints(kind), checkpoints.hf_model(kind)
    ids_list = prompts(directory)
    assert max(len(ids) for ids in ids_list) > 12
    chunked = await generate_all(
        open_engine, directory, ids_list, block_size=4, max_num_batched_tokens=6
    )
    one_shot = await generate_all(open_engine, directory, ids_list, max_num_batched_tokens=512)
    assert chunked == one_shot == [hf_greedy(hf, ids) for ids in ids_list]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_prefix_cache_hit_gives_the_same_tokens(
    checkpoints: Any, kind: str, open_engine: Any
) -> None:
    directory, hf = checkpoints(kind), checkpoints.hf_model(kind)
    a, b, _, d = prompts(directory)
    shared = d + a  # a long common prefix, then different endings
    first, second = shared + b[1:5], shared + b[5:]
    reused: list[int] = []  # prompt tokens each request found computed (stats())
    async with open_engine(str(directory), dtype="float32", block_size=4) as engine:

        async def greedy(ids: list[int]) -> Any:
            before = engine.stats()["prompt_tokens_reused"]
            out = await engine.generate(ids, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            reused.append(engine.stats()["prompt_tokens_reused"] - before)
            return out

        cold, warm_same, warm_other = await greedy(first), await greedy(first), await greedy(second)
    # Whole 4-token blocks come from the cache (a prompt's last token is always computed).
    assert reused[0] == 0
    assert reused[1] >= (len(first) // 4 - 1) * 4 and reused[2] >= (len(shared) // 4) * 4
    assert list(cold.token_ids) == list(warm_same.token_ids) == hf_greedy(hf, first)
    assert list(warm_other.token_ids) == hf_greedy(hf, second)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_prompt_logprobs_match_transformers(
    checkpoints: Any, kind: str, open_engine: Any
) -> None:
    """Each prompt token's log-probability (and the most likely token before it) is
    `transformers`' log-softmax of the logits at the token before, through prefill
    chunks of 5 tokens."""
    directory, hf = checkpoints(kind), checkpoints.hf_model(kind)
    ids = prompts(directory)[1]
    expected = torch.log_softmax(hf_logits(hf, ids), dim=-1)
    async with open_engine(
        str(directory), dtype="float32", block_size=4, max_num_batched_tokens=5
    ) as engine:
        out = await engine.generate(ids, temperature=0, max_tokens=1, prompt_logprobs=1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for position, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert lp is not None
        assert lp.logprob == pytest.approx(expected[position - 1, ids[position]].item(), abs=1e-3)
        assert lp.top[0][0] == int(expected[position - 1].argmax())


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
async def test_bfloat16_loads_and_runs(
    checkpoints: Any, kind: str, open_engine: Any, attention_path: str
) -> None:
    directory, hf = checkpoints(kind), checkpoints.hf_model(kind)
    ids = prompts(directory)[0]
    loaded = load_model(str(directory), device=CPU, dtype="bfloat16")
    # Checked against F.linear at load.
    assert loaded.model.linear_layout in ("wide-prepacked", "wide", "prepacked")
    assert loaded.model.dtype == torch.bfloat16 and loaded.model.embed.dtype == torch.bfloat16
    logits = Cache(loaded).step([(0, ids, 0)])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # bfloat16 keeps 8 bits of mantissa: close to float32, not equal.
    assert_close(logits, hf_logits(hf, ids), rtol=0.1)
    async with open_engine(str(directory), dtype="bfloat16") as engine:
        out = await engine.generate(ids, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert len(out.token_ids) == NEW_TOKENS and out.finish_reason == "length"
    assert out.token_ids[0] == hf_greedy(hf, ids, 1)[0]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_embeddings_match_transformers(checkpoints: Any, kind: str, open_engine: Any) -> None:
    """An `embed` request's answer is `transformers`' last hidden state of the prompt's
    last token, L2-normalized: computed in prefill chunks of 5 tokens, from a cached
    prefix, and batched beside a generation that stays `generate`'s."""
    directory, hf = checkpoints(kind), checkpoints.hf_model(kind)
    texts = prompts(directory)
    with torch.no_grad():
        expected = [
            torch.nn.functional.normalize(
                hf.model(torch.tensor([ids])).last_hidden_state[0, -1].float(), dim=-1
            )
            for ids in texts
        ]
    async with open_engine(
        str(directory), dtype="float32", block_size=4, max_num_batched_tokens=5
    ) as engine:
        results: dict[str, Any] = {}

        async def run(name: str, ids: list[int], **options: Any) -> None:
            results[name] = await engine.generate(ids, **options)

        async with anyio.create_task_group() as tg:
            for i, ids in enumerate(texts):
                tg.start_soon(functools.partial(run, f"embed{i}", ids, embed=True))
            tg.start_soon(functools.partial(run, "greedy", texts[0], temperature=0, max_tokens=8))
        again = await engine.generate(texts[1], embed=True)  # its prefix from the cache
    assert again.cached_tokens > 0
    for i, reference in enumerate(expected):
        out = results[f"embed{i}"]
        assert out.finish_reason == "stop" and out.token_ids == () and out.embedding is not None
        assert_close(torch.tensor(out.embedding), reference)
    assert_close(torch.tensor(again.embedding), expected[1])
    assert list(results["greedy"].token_ids) == hf_greedy(hf, texts[0], 8)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("kind", ["qwen3", "mistral"])
async def test_a_decoder_saved_alone_answers_embeddings_only(
    tmp_path: Any, kind: str, open_engine: Any
) -> None:
    """An embedding model's checkpoint (the decoder alone, `Qwen3Model`: tensors named
    without `model.`, no output head) loads; its embeddings are `transformers`'; a
    generation is refused, saying why."""
    import transformers

    from kvscope import InvalidRequest
    from tests.models.conftest import build_checkpoint

    directory = build_checkpoint(kind, tmp_path / kind, decoder_alone=True)
    hf = transformers.AutoModel.from_pretrained(directory).eval()
    ids = prompts(directory)[3]
    with torch.no_grad():
        last = hf(torch.tensor([ids])).last_hidden_state[0, -1].float()
    async with open_engine(str(directory), dtype="float32") as engine:
        out = await engine.generate(ids, embed=True)
        assert out.embedding is not None
        assert_close(torch.tensor(out.embedding), torch.nn.functional.normalize(last, dim=-1))
        with pytest.raises(InvalidRequest, match="embeddings only"):
            await engine.generate(ids, max_tokens=2)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_sentence_transformers_pooling_other_than_the_last_token_is_refused(
    tmp_path: Any, open_engine: Any
) -> None:
    """A checkpoint's sentence-transformers modules say how it embeds: last-token
    pooling (and normalizing) is kvscope's; mean pooling, or a module kvscope does not
    run (a Dense projection), would be answered wrongly, so an embedding is refused."""
    import json

    from kvscope import InvalidRequest
    from tests.models.conftest import build_checkpoint

    directory = build_checkpoint("qwen3", tmp_path / "st", decoder_alone=True)
    (directory / "1_Pooling").mkdir()
    pooling = directory / "1_Pooling" / "config.json"
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    modes = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False}
    cases = [
        (modules, {**modes, "pooling_mode_lasttoken": True}, None),
        (modules, {**modes, "pooling_mode_mean_tokens": True}, "pools by mean_tokens"),
        ([*modules, dense], {**modes, "pooling_mode_lasttoken": True}, "include Dense"),
    ]
    for listed, config, refused in cases:
        (directory / "modules.json").write_text(json.dumps(listed))
        pooling.write_text(json.dumps(config))
        async with open_engine(str(directory), dtype="float32") as engine:
            if refused is None:
                assert (await engine.generate([5, 6, 7], embed=True)).embedding is not None
            else:
                with pytest.raises(InvalidRequest, match=refused):
                    await engine.generate([5, 6, 7], embed=True)
