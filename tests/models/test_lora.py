"""LoRA adapters against PEFT over `transformers`: adapters saved by PEFT itself
(`save_pretrained`) on tiny random checkpoints of every architecture, then served.

Logits within the parity tolerance, whole and with every linear layer in column pieces;
greedy tokens identical to the PEFT model's `generate` when requests of two adapters
and of the base model share steps beside cancelled ones, through chunked prefill, and
after the base model has cached the same prompt (an adapter's K/V are its own). An
adapter the engine cannot serve is refused at open, naming what it holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvscope.errors import InvalidRequest
from kvscope.kernels.slicing import LinearSlicer
from kvscope.models.errors import ModelLoadError
from kvscope.models.loader import load_model
from kvscope.models.lora import lora_rows

from .test_parity import CPU, Cache, assert_close, hf_greedy, hf_logits, prompts

peft = pytest.importorskip("peft")

#: Two adapters: one of the attention's projections at rank 4, one of every linear at
#: rank 8 with rsLoRA's scaling.
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "every": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
}


def save_adapter(hf: Any, directory: Path, seed: int, **settings: Any) -> Any:
    """A PEFT LoRA adapter of `hf` with random A and B (PEFT starts B at zero), saved
    into `directory`; returns the PEFT model (the reference) in eval mode."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(lora_dropout=0.0, init_lora_weights=False, **settings)
    model = peft.get_peft_model(_fresh_copy(hf), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    return model.eval()


def _fresh_copy(hf: Any) -> Any:
    copy = type(hf)(hf.config)
    copy.load_state_dict(hf.state_dict())
    return copy.eval()


class Adapters:
    """The two adapters of one checkpoint kind, saved once per session."""

    def __init__(self, checkpoints: Any, root: Path) -> None:
        self.checkpoints = checkpoints
        self.root = root
        self._saved: dict[str, tuple[dict[str, str], dict[str, Any]]] = {}

    def __call__(self, kind: str) -> tuple[dict[str, str], dict[str, Any]]:
        """The adapters' directories and their PEFT models, by name."""
        if kind not in self._saved:
            hf = self.checkpoints.hf_model(kind)
            paths, models = {}, {}
            for seed, (name, settings) in enumerate(ADAPTERS.items()):
                path = self.root / kind / name
                models[name] = save_adapter(hf, path, seed, **settings)
                paths[name] = str(path)
            self._saved[kind] = (paths, models)
        return self._saved[kind]


@pytest.fixture(scope="session")
def adapters(checkpoints: Any, tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    return Adapters(checkpoints, tmp_path_factory.mktemp("adapters"))


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "linears-in-pieces"])
def test_logits_match_peft(checkpoints: Any, adapters: Adapters, kind: str, pieces: bool) -> None:
    """Three prompts in one step, each with another adapter (or none); and again with
    every linear layer cut into as many column pieces as it allows."""
    directory = checkpoints(kind)
    paths, models = adapters(kind)
    loaded = load_model(str(directory), device=CPU, dtype="float32", lora_modules=paths.items())
    a, b, c, _ = prompts(directory)
    slicer = LinearSlicer(target=1e-12, min_columns=64) if pieces else None
    cache = Cache(loaded)
    chunks = [(0, a, 0), (1, b, 0), (2, c, 0)]
    chunk_adapters = [("every", len(a)), (None, len(b)), ("attn", len(c))]
    lora = lora_rows(loaded.model.adapters, chunk_adapters, CPU)
    logits = cache.step(chunks, slicer=slicer, lora=lora)
    base = checkpoints.hf_model(kind)
    assert_close(logits[: len(a)], hf_logits(models["every"], a))
    assert_close(logits[len(a) : len(a) + len(b)], hf_logits(base, b))
    assert_close(logits[len(a) + len(b) :], hf_logits(models["attn"], c))
    # The adapters change the answer (else the test above proves nothing).
    assert not torch.allclose(hf_logits(models["every"], a), hf_logits(base, a), rtol=1e-2)


@pytest.mark.anyio
async def test_greedy_batched_with_cancellations_matches_peft(
    checkpoints: Any, adapters: Adapters, kind: str, open_engine: Any
) -> None:
    """Every prompt on each adapter and on the base model in one batch, prefilled in
    chunks of 6 tokens, beside requests cancelled part-way; each survivor's tokens are
    what its PEFT model's `generate` gives its prompt alone."""
    directory = checkpoints(kind)
    paths, models = adapters(kind)
    ids_list = prompts(directory)
    plan = [(ids, lora) for ids in ids_list for lora in (None, "attn", "every")]
    references = {None: checkpoints.hf_model(kind), **models}
    expected = [hf_greedy(references[lora], ids) for ids, lora in plan]
    async with open_engine(
        str(directory),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=6 * len(plan),
        lora_modules=paths,
    ) as engine:
        victims = [
            await engine.submit(ids[:4], temperature=0, max_tokens=200, ignore_eos=True, lora=lora)
            for ids, lora in plan[:4]
        ]
        jobs = [
            await engine.submit(ids, temperature=0, max_tokens=32, ignore_eos=True, lora=lora)
            for ids, lora in plan
        ]
        for victim in victims:
            async for _delta in engine.watch(victim.id):
                break
            assert (await engine.cancel(victim.id)).found
        done = [await job.wait() for job in jobs]
    assert [list(c.token_ids) for c in done] == expected


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_adapter_does_not_reuse_the_base_models_cached_prompt(
    checkpoints: Any, adapters: Adapters, open_engine: Any
) -> None:
    """The same prompt on the base model, then on an adapter, then on it again: the
    adapter's first run computes the prompt afresh and its second reuses its own."""
    directory = checkpoints("llama")
    paths, models = adapters("llama")
    a, b, _, _ = prompts(directory)
    ids = a + b
    async with open_engine(
        str(directory), dtype="float32", block_size=4, lora_modules=paths
    ) as engine:

        async def greedy(lora: str | None) -> tuple[list[int], int]:
            before = engine.stats()["prompt_tokens_reused"]
            out = await engine.generate(
                ids, temperature=0, max_tokens=16, ignore_eos=True, lora=lora
            )
            return list(out.token_ids), engine.stats()["prompt_tokens_reused"] - before

        base, reused_base = await greedy(None)
        first, reused_first = await greedy("every")
        again, reused_again = await greedy("every")
    assert reused_base == 0 and reused_first == 0 and reused_again > 0
    assert first == again == hf_greedy(models["every"], ids, 16)
    assert base == hf_greedy(checkpoints.hf_model("llama"), ids, 16) != first


@pytest.mark.anyio
async def test_a_child_of_another_adapter_computes_its_own_prefix(
    checkpoints: Any, adapters: Adapters, open_engine: Any
) -> None:
    """A child request shares its parent's blocks for their common prefix only where
    both run with the same adapter (or none): a child of the base model under a parent
    of an adapter, and one of the parent's own adapter, each get their own model's
    tokens."""
    directory = checkpoints("llama")
    paths, models = adapters("llama")
    a, b, _, _ = prompts(directory)
    async with open_engine(
        str(directory), dtype="float32", block_size=4, lora_modules=paths
    ) as engine:
        parent = await engine.submit(
            a + b, temperature=0, max_tokens=200, ignore_eos=True, lora="every"
        )
        async for _delta in engine.watch(parent.id):
            break  # its prompt is computed
        greedy = dict(temperature=0, max_tokens=16, ignore_eos=True, parent=parent.id)
        base_child = await engine.generate(a + b, **greedy)
        own_child = await engine.generate(a + b, lora="every", **greedy)
        await engine.cancel(parent.id)
    assert list(base_child.token_ids) == hf_greedy(checkpoints.hf_model("llama"), a + b, 16)
    assert list(own_child.token_ids) == hf_greedy(models["every"], a + b, 16)
    assert own_child.cached_tokens > 0 and base_child.cached_tokens == 0


@pytest.mark.anyio
async def test_the_engine_names_the_adapters_running_and_waiting(
    checkpoints: Any, adapters: Adapters, open_engine: Any
) -> None:
    """One sequence runs at a time: the first request's adapter is running, the queued
    one's waiting; once both end, neither."""
    paths, _ = adapters("llama")
    async with open_engine(
        str(checkpoints("llama")), dtype="float32", lora_modules=paths, max_num_seqs=1
    ) as engine:
        assert engine.scheduled_adapters() == ([], [])
        long = dict(temperature=0, max_tokens=400, ignore_eos=True)
        first = await engine.submit("hello", lora="attn", **long)
        async for _delta in engine.watch(first.id):
            break  # it runs
        second = await engine.submit("hello", lora="every", **long)
        assert engine.scheduled_adapters() == (["attn"], ["every"])
        await engine.cancel(second.id)
        await engine.cancel(first.id)
        assert engine.scheduled_adapters() == ([], [])


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_adapter_that_is_not_loaded_is_refused(
    checkpoints: Any, adapters: Adapters, open_engine: Any
) -> None:
    paths, _ = adapters("llama")
    async with open_engine(
        str(checkpoints("llama")), dtype="float32", lora_modules=paths
    ) as engine:
        with pytest.raises(InvalidRequest, match="no LoRA adapter 'sql' is loaded"):
            await engine.generate("hello", max_tokens=2, lora="sql")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_adapter_named_as_the_model_is_refused_at_open(
    checkpoints: Any, adapters: Adapters, open_engine: Any
) -> None:
    """The model could not be asked for by its name beside it."""
    paths, _ = adapters("llama")
    with pytest.raises(ModelLoadError, match="the model's own name"):
        async with open_engine(
            str(checkpoints("llama")), dtype="float32", lora_modules={"llama": paths["attn"]}
        ):
            pass


def _copy_adapter(source: str, target: Path, **changes: Any) -> Path:
    target.mkdir()
    settings = json.loads((Path(source) / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**settings, **changes}))
    weights = Path(source) / "adapter_model.safetensors"
    (target / weights.name).write_bytes(weights.read_bytes())
    return target


@pytest.mark.parametrize(
    ("changes", "rank", "refusal"),
    [
        ({"use_dora": True}, None, "use_dora=True is not served"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save=\\['lm_head'\\] is not served"),
        ({"peft_type": "IA3"}, None, "is a IA3 adapter"),
        ({}, 4, "rank 8 is over max_lora_rank \\(4\\)"),
    ],
)
def test_an_adapter_that_cannot_be_served_is_refused_at_load(
    checkpoints: Any,
    adapters: Adapters,
    tmp_path: Path,
    changes: dict[str, Any],
    rank: int | None,
    refusal: str,
) -> None:
    paths, _ = adapters("llama")
    changed = _copy_adapter(paths["every"], tmp_path / "changed", **changes)
    with pytest.raises(ModelLoadError, match=refusal):
        load_model(
            str(checkpoints("llama")),
            device=CPU,
            dtype="float32",
            lora_modules=[("changed", str(changed))],
            max_lora_rank=rank,
        )


def test_an_adapter_for_another_model_is_refused_at_load(
    checkpoints: Any, adapters: Adapters, tmp_path: Path
) -> None:
    """An adapter whose matrices do not fit the model (one saved for a model of
    another size) is refused, naming the first that does not fit."""
    from safetensors.torch import load_file, save_file

    paths, _ = adapters("llama")
    changed = _copy_adapter(paths["every"], tmp_path / "changed")
    weights = changed / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = next(k for k in tensors if k.endswith("layers.1.mlp.down_proj.lora_A.weight"))
    tensors[key] = tensors[key][:, :32].contiguous()
    save_file(tensors, str(weights))
    with pytest.raises(ModelLoadError, match="layer 1 down_proj: lora_A has shape \\(8, 32\\)"):
        load_model(
            str(checkpoints("llama")),
            device=CPU,
            dtype="float32",
            lora_modules=[("changed", str(changed))],
        )
