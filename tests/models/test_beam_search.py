"""Beam search (`kvscope.beam_search`, vLLM's algorithm) against `transformers`.

Without an EOS the search is the classic one, so its beams are those of
`generate(num_beams=...)` and each beam's cumulative log-probability is the sum of its
tokens' under the reference model. An EOS among a step's candidates ends a beam
(`stop`), kept in `token_ids` only with `include_stop_str_in_output` and never in the
text. Leaving the call cancels the step's requests; a DELETE of one ends the search
with the beams found so far (`cancelled`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from kvscope import BeamSearchParams, InvalidRequest
from kvscope.beam_search import beam_search

from .test_parity import hf_logits, prompts

WIDTH, NEW_TOKENS = 3, 8


def hf_beams(hf: Any, ids: list[int], width: int, new_tokens: int) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=2,
        )
    return [row[len(ids) :].tolist() for row in out]


def sum_logprobs(hf: Any, ids: list[int], tokens: list[int]) -> float:
    logprobs = torch.log_softmax(hf_logits(hf, ids + tokens), dim=-1)
    return sum(float(logprobs[len(ids) - 1 + i, t]) for i, t in enumerate(tokens))


@pytest.mark.anyio
async def test_beams_are_those_of_transformers(checkpoints: Any, open_engine: Any) -> None:
    directory = checkpoints("llama")
    hf = checkpoints.hf_model("llama")
    ids = prompts(directory)[0]
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=NEW_TOKENS, ignore_eos=True)
    async with open_engine(str(directory), dtype="float32", block_size=4) as engine:
        beams = await beam_search(engine, ids, params)
    assert [list(b.token_ids) for b in beams] == hf_beams(hf, ids, WIDTH, NEW_TOKENS)
    for beam in beams:
        assert beam.finish_reason == "length" and beam.prompt_tokens == len(ids)
        expected = sum_logprobs(hf, ids, list(beam.token_ids))
        assert beam.cumulative_logprob == pytest.approx(expected, abs=1e-3)
    scores = [b.cumulative_logprob for b in beams]
    assert scores == sorted(scores, reverse=True)


def with_eos(source: Path, target: Path, eos: int) -> Path:
    """`source`'s checkpoint, its EOS token `eos`."""
    target.mkdir()
    for path in source.iterdir():
        if path.name not in ("config.json", "generation_config.json"):
            (target / path.name).symlink_to(path)
    for name in ("config.json", "generation_config.json"):
        if (source / name).exists():
            settings = json.loads((source / name).read_text())
            settings["eos_token_id"] = eos
            (target / name).write_text(json.dumps(settings))
    return target


@pytest.mark.anyio
@pytest.mark.parametrize("keep_eos", [False, True])
async def test_an_eos_ends_its_beam(
    checkpoints: Any, open_engine: Any, tmp_path: Path, keep_eos: bool
) -> None:
    """The best beam's second token, made the model's EOS, ends that beam there (a
    prompt whose best beam does not open with that token twice)."""
    directory = checkpoints("llama")
    free = BeamSearchParams(beam_width=WIDTH, max_tokens=NEW_TOKENS, ignore_eos=True)
    async with open_engine(str(directory), dtype="float32") as engine:
        for ids in prompts(directory):
            first, second = (await beam_search(engine, ids, free))[0].token_ids[:2]
            if first != second:
                break
    model = with_eos(directory, tmp_path / "eos", second)
    params = BeamSearchParams(
        beam_width=WIDTH, max_tokens=NEW_TOKENS, include_stop_str_in_output=keep_eos
    )
    async with open_engine(str(model), dtype="float32") as engine:
        beams = await beam_search(engine, ids, params)
        text = engine.tokenizer.decode([first])
    ended = [first, second] if keep_eos else [first]
    assert any(
        list(b.token_ids) == ended and b.finish_reason == "stop" and b.text == text for b in beams
    ), [(b.token_ids, b.finish_reason, b.text) for b in beams]
    assert all(second not in b.token_ids[:-1] for b in beams)  # no beam goes past an EOS


@pytest.mark.anyio
async def test_leaving_the_search_cancels_its_requests(open_engine: Any) -> None:
    async with open_engine() as engine:
        params = BeamSearchParams(beam_width=2, max_tokens=200, ignore_eos=True)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(beam_search, engine, "hello there", params)
                with anyio.fail_after(30):
                    while not engine.list_requests():
                        await anyio.sleep(0.001)
                scope.cancel()
        assert engine.stats()["live_requests"] == 0
        assert engine.stats()["kv_blocks_in_use"] == 0


@pytest.mark.anyio
async def test_a_delete_ends_the_search_with_its_beams_so_far(open_engine: Any) -> None:
    async with open_engine() as engine:
        params = BeamSearchParams(beam_width=2, max_tokens=200, ignore_eos=True)
        found: list[Any] = []

        async def search() -> None:
            found.extend(await beam_search(engine, "hello there", params))

        async with anyio.create_task_group() as tg:
            tg.start_soon(search)
            seen: set[str] = set()
            with anyio.fail_after(30):
                while len(seen) < 6:  # three steps' requests
                    seen |= {info.id for info in engine.list_requests()}
                    await anyio.sleep(0.001)
                while not (live := [i for i in engine.list_requests() if not i.finish_reason]):
                    await anyio.sleep(0.001)
            await engine.cancel(live[0].id)
    assert len(found) == 2 and all(b.finish_reason == "cancelled" for b in found)
    assert all(2 <= len(b.token_ids) < 200 for b in found)


def test_a_width_it_cannot_search_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="beam width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
