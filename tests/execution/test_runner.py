"""The model runner's step control: a chunk cancelled between layers leaves the batch,
is handed back at once, and the other chunks' results do not change."""

from __future__ import annotations

import pytest
import torch

from kvscope.cache.kv_cache import KVCache
from kvscope.execution.runner import ModelRunner
from kvscope.execution.step_input import ChunkInput, StepControl, StepInput
from kvscope.kernels.attention import block_major_cache
from kvscope.models.llama import LayerBatch, StepAborted
from kvscope.models.loader import tiny_random
from kvscope.params import SamplingParams

GREEDY = SamplingParams(temperature=0)


def make_runner(dtype: torch.dtype = torch.float32) -> ModelRunner:
    loaded = tiny_random(device=torch.device("cpu"), dtype=dtype, seed=3)
    c = loaded.config
    kv = KVCache(
        num_layers=c.num_layers,
        num_blocks=32,
        block_size=4,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
        block_major=block_major_cache(torch.device("cpu")),
    )
    return ModelRunner(loaded.model, kv)


def chunks() -> list[ChunkInput]:
    return [
        ChunkInput([5], 0, [0], True, GREEDY, None),  # a one-token chunk (decode row)
        ChunkInput(list(range(10, 19)), 0, [1, 2, 3], True, GREEDY, None),
        ChunkInput(list(range(30, 37)), 0, [4, 5], True, GREEDY, None),
    ]


class CancelAtLayer(StepControl):
    """Cancels `chunk` just before checkpoint `layer`, as the event loop would."""

    def __init__(self, chunk: int, layer: int) -> None:
        super().__init__()
        self.chunk, self.layer, self.calls = chunk, layer, 0
        self.handed_back: list[list[int]] = []

    def take_cancelled(self) -> set[int]:
        if self.calls == self.layer:
            self.cancel(self.chunk)
        self.calls += 1
        return super().take_cancelled()

    def dropped(self, chunk_ids: list[int]) -> None:
        self.handed_back.append(chunk_ids)


@pytest.mark.parametrize("chunk", [0, 1, 2])
@pytest.mark.parametrize("layer", [0, 1, 2, 3])  # checkpoints: 2 a layer
def test_a_chunk_cancelled_between_layers_is_dropped_and_the_rest_is_unchanged(
    chunk: int, layer: int
):
    whole = make_runner().execute(StepInput(chunks(), []))
    control = CancelAtLayer(chunk, layer)
    pruned = make_runner().execute(StepInput(chunks(), []), control)
    assert control.handed_back == [[chunk]]
    assert pruned[chunk] is None
    assert [t for i, t in enumerate(pruned) if i != chunk] == [
        t for i, t in enumerate(whole) if i != chunk
    ]


def test_nobody_left_or_the_abort_flag_stops_the_forward():
    runner = make_runner()
    control = StepControl()
    for index in range(3):
        control.cancel(index)
    with pytest.raises(StepAborted):
        runner.execute(StepInput(chunks(), []), control)
    control = StepControl()
    control.abort.set()
    with pytest.raises(StepAborted):
        runner.execute(StepInput(chunks(), []), control)


def test_the_checkpoint_runs_twice_a_layer_and_after_the_last():
    runner = make_runner()
    seen: list[int | None] = []

    def hook(batch: LayerBatch | None) -> None:
        seen.append(None if batch is None else batch.hidden.shape[0])

    runner.model.forward(
        torch.tensor([1, 2, 3]),
        torch.tensor([0, 1, 2]),
        runner.metadata([ChunkInput([1, 2, 3], 0, [0], True, GREEDY, None)], [0]),
        runner.kv_cache,
        hook,
    )
    # before each layer's attention and MLP, and before the final norm; no slicer, so
    # no checkpoint where rows cannot leave
    assert seen == [3] * (2 * runner.model.config.num_layers + 1)


def make_sliced_runner() -> ModelRunner:
    """A runner that cuts every linear layer into as many pieces as it allows."""
    plain = make_runner()
    runner = ModelRunner(plain.model, plain.kv_cache, checkpoint_gap=1e-12)
    assert runner.slicer is not None
    runner.slicer.min_columns = 32  # the tiny model's layers are narrow
    return runner


class Counting(StepControl):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def take_cancelled(self) -> set[int]:
        self.calls += 1
        return super().take_cancelled()


def test_linears_in_pieces_add_checkpoints_and_change_no_token():
    whole = make_runner().execute(StepInput(chunks(), []), Counting())
    runner = make_sliced_runner()
    control = Counting()
    assert runner.execute(StepInput(chunks(), []), control) == whole
    layers = runner.model.config.num_layers
    assert control.calls > 2 * layers + 1
    # every checkpoint's gap, the step's first (from its start) and its last (to its end)
    assert runner.gaps.statistics().count == control.calls + 1


def sliced_checkpoints() -> int:
    control = Counting()
    make_sliced_runner().execute(StepInput(chunks(), []), control)
    return control.calls


@pytest.mark.parametrize("chunk", [0, 2])
def test_a_chunk_cancelled_at_any_checkpoint_is_released_once_and_the_rest_unchanged(
    chunk: int,
):
    """Between the pieces of a linear layer its rows cannot leave the batch yet: the
    chunk is handed back there at once, and its rows leave at the next checkpoint that
    allows it (before any KV block is touched). Every checkpoint in one test: how many
    there are depends on the prefill attention's path (the compiled kernel, once built
    and timed faster than SDPA, cuts by rows), so they are counted when the test runs,
    not when it is collected, and the suite's count stays the same on every machine."""
    whole = make_runner().execute(StepInput(chunks(), []))
    checkpoints = sliced_checkpoints()
    for at in range(checkpoints):
        control = CancelAtLayer(chunk, at)
        pruned = make_sliced_runner().execute(StepInput(chunks(), []), control)
        where = f"cancelled at checkpoint {at} of {checkpoints}"
        assert control.handed_back == [[chunk]], where
        assert pruned[chunk] is None, where
        assert [t for i, t in enumerate(pruned) if i != chunk] == [
            t for i, t in enumerate(whole) if i != chunk
        ], where


def test_gaps_are_counted_for_an_aborted_step_too():
    runner = make_runner()
    control = StepControl()
    control.abort.set()
    with pytest.raises(StepAborted):
        runner.execute(StepInput(chunks(), []), control)
    assert runner.gaps.statistics().count == 2  # start -> first checkpoint -> end
