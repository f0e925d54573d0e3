"""LoRA adapters served beside the base model (vLLM's multi-LoRA serving).

An adapter is a directory as PEFT saves it (`adapter_config.json` and
`adapter_model.safetensors`, or `adapter_model.bin`) holding low-rank `A` and `B`
matrices for some of a layer's projections (q, k, v, o, gate, up, down). A request
names the adapter it runs with (`SamplingParams.lora`); the rows of a step that run
with an adapter add `scaling * B (A x)` to each adapted projection's output, while the
rest of the batch runs the base model alone, so requests of several adapters and of the
base model share one forward (one base matrix multiply per projection, then one small
pair per adapter present).

The decoder fuses q/k/v and gate/up into one matrix each (`models/llama.py`); an
adapter's matrices are fused the same way when it is read: the parts' `A`s stacked, and
their `B`s placed block-diagonally with each part's scaling folded in, so a fused
projection's delta is one pair of multiplies. The delta is computed in float32 and
added to the projection's output before it is rounded back to the model's dtype, as
PEFT computes it (it upcasts adapter weights to float32 by default), so greedy tokens
match PEFT's over `transformers`.

What an adapter may hold is checked when it is read, naming what is not served: a
tensor other than a layer projection's `lora_A`/`lora_B` (an adapted embedding or
output head, `modules_to_save`), DoRA, biases, `alpha_pattern`, shapes that do not fit
the base model, a rank over the engine's `max_lora_rank`.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from .config import ModelConfig
from .errors import ModelLoadError

log = logging.getLogger(__name__)

#: A projection's PEFT name -> (the fused linear it is part of, its index among the parts).
PARTS = {
    "q": ("qkv", 0),
    "k": ("qkv", 1),
    "v": ("qkv", 2),
    "o": ("o_proj", 0),
    "gate": ("gate_up", 0),
    "up": ("gate_up", 1),
    "down": ("down", 0),
}
#: The fused linears' names, as `LayerWeights` has them.
FUSED = ("qkv", "o_proj", "gate_up", "down")
_KEY = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q|k|v|o|gate|up|down)_proj\.lora_([AB])\.weight$"
)
#: adapter_config.json settings that change what the adapter computes and are not
#: served, with the value that means "not used".
_UNSERVED = {
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "alpha_pattern": {},
    "layer_replication": None,
}


class LoraError(ModelLoadError):
    """An adapter that cannot be read or served; the message names it and why."""


@attrs.frozen(eq=False)
class Delta:
    """One fused projection's low-rank update: `x -> (x A^T) B^T`, in float32."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank], each part's scaling folded in

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.a.T) @ self.b.T


@attrs.frozen(eq=False)
class LoraAdapter:
    name: str
    path: str
    #: The largest rank of its matrices.
    rank: int
    #: Per layer, the fused projections it adapts.
    layers: tuple[Mapping[str, Delta], ...]

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for d in layer.values() for t in (d.a, d.b)]


def part_sizes(config: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Each fused linear's input size and its parts' output sizes."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "qkv": (c.hidden_size, [q, kv, kv]),
        "o_proj": (q, [c.hidden_size]),
        "gate_up": (c.hidden_size, [c.intermediate_size, c.intermediate_size]),
        "down": (c.intermediate_size, [c.hidden_size]),
    }


def read_adapter(
    name: str, path: str, config: ModelConfig, *, device: torch.device, max_rank: int | None
) -> LoraAdapter:
    """The adapter saved in `path`, fused for a model of `config`."""
    directory = Path(path)
    settings = _settings(name, directory)
    tensors = _tensors(name, directory)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraError(
                f"LoRA adapter {name!r}: tensor {key!r} is not served (only "
                "the layers' q/k/v/o/gate/up/down projections' lora_A and lora_B)"
            )
        layer, projection, which = int(match[1]), match[2], match[3]
        if layer >= config.num_layers:
            raise LoraError(
                f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}, but the "
                f"model has {config.num_layers}"
            )
        parts.setdefault((layer, projection), {})[which] = tensor.float()
    if not parts:
        raise LoraError(f"LoRA adapter {name!r} in {path} holds no lora_A/lora_B tensors")
    sizes = part_sizes(config)
    rank = 0
    layers: list[dict[str, Delta]] = [{} for _ in range(config.num_layers)]
    by_linear: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, projection), pair in parts.items():
        fused, index = PARTS[projection]
        in_features, outs = sizes[fused]
        where = f"LoRA adapter {name!r}, layer {layer} {projection}_proj"
        if set(pair) != {"A", "B"}:
            raise LoraError(f"{where}: lora_A and lora_B must both be given")
        a, b = pair["A"], pair["B"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, in_features):
            raise LoraError(f"{where}: lora_A has shape {tuple(a.shape)}, not (r, {in_features})")
        if tuple(b.shape) != (outs[index], r):
            raise LoraError(f"{where}: lora_B has shape {tuple(b.shape)}, not ({outs[index]}, {r})")
        if max_rank is not None and r > max_rank:
            raise LoraError(f"{where}: rank {r} is over max_lora_rank ({max_rank})")
        rank = max(rank, r)
        by_linear.setdefault((layer, fused), {})[index] = (a, b * _scaling(settings, r))
    for (layer, fused), given in by_linear.items():
        _, outs = sizes[fused]
        a = torch.cat([given[i][0] for i in sorted(given)])
        b = torch.zeros(sum(outs), a.shape[0])
        row, column = 0, 0
        for i, out in enumerate(outs):
            if i in given:
                part = given[i][1]
                b[row : row + out, column : column + part.shape[1]] = part
                column += part.shape[1]
            row += out
        layers[layer][fused] = Delta(a.to(device).contiguous(), b.to(device).contiguous())
    return LoraAdapter(name, path, rank, tuple(layers))


def check_adapter_name(name: str, model_name: str) -> None:
    """An adapter's name must not be empty nor the served model's own, which then could
    not be asked for by name (the OpenAI routes' `model`)."""
    if not name.strip() or name == model_name:
        raise LoraError(f"{name!r} cannot name a LoRA adapter (empty, or the model's own name)")


def read_adapters(
    modules: Iterable[tuple[str, str]],
    config: ModelConfig,
    *,
    device: torch.device,
    max_rank: int | None,
) -> dict[str, LoraAdapter]:
    adapters = {}
    for name, path in modules:
        adapter = adapters[name] = read_adapter(
            name, path, config, device=device, max_rank=max_rank
        )
        adapted = sum(len(layer) for layer in adapter.layers)
        log.info(
            "LoRA adapter %r from %s: rank %d, %d projections", name, path, adapter.rank, adapted
        )
    return adapters


def _settings(name: str, directory: Path) -> dict[str, Any]:
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: no adapter_config.json in {directory}")
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"LoRA adapter {name!r}: {config_file} cannot be read: {exc}") from None
    if not isinstance(settings, dict):
        raise LoraError(f"LoRA adapter {name!r}: {config_file} is not a JSON object")
    kind = settings.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoraError(f"LoRA adapter {name!r} is a {kind} adapter; only LORA is served")
    for setting, unused in _UNSERVED.items():
        value = settings.get(setting, unused)
        if value != unused and not (unused is None and not value):
            raise LoraError(f"LoRA adapter {name!r}: {setting}={value!r} is not served")
    alpha = settings.get("lora_alpha", settings.get("r", 8))
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraError(f"LoRA adapter {name!r}: lora_alpha must be a number, not {alpha!r}")
    return settings


def _scaling(settings: Mapping[str, Any], rank: int) -> float:
    """PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    alpha = float(settings.get("lora_alpha", settings.get("r", 8)))
    return alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)


def _tensors(name: str, directory: Path) -> dict[str, torch.Tensor]:
    safetensors_file = directory / "adapter_model.safetensors"
    bin_file = directory / "adapter_model.bin"
    try:
        if safetensors_file.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors_file))
        if bin_file.is_file():
            loaded = torch.load(bin_file, map_location="cpu", weights_only=True)
            return dict(loaded)
    except Exception as exc:  # a corrupt or truncated file: any of several errors
        raise LoraError(f"LoRA adapter {name!r}: its weights cannot be read: {exc}") from None
    raise LoraError(
        f"LoRA adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {directory}"
    )


@attrs.frozen(eq=False)
class LoraRows:
    """Which rows of a batch run with which adapter: each adapter present and its rows
    (a slice where they are one run, else an index tensor)."""

    groups: tuple[tuple[LoraAdapter, slice | torch.Tensor], ...]

    def adapts(self, layer: int, *fused: str) -> bool:
        return any(name in adapter.layers[layer] for adapter, _ in self.groups for name in fused)

    def apply(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add each adapter's delta of projection `fused` (input `x`, output `y`) to
        its rows of `y`, in place; returns `y`."""
        for adapter, rows in self.groups:
            delta = adapter.layers[layer].get(fused)
            if delta is not None:
                y[rows] = (y[rows].float() + delta(x[rows])).to(y.dtype)
        return y


def lora_rows(
    adapters: Mapping[str, LoraAdapter],
    chunks: Sequence[tuple[str | None, int]],
    device: torch.device,
) -> LoraRows | None:
    """The `LoraRows` of a batch whose chunks are (adapter name or None, rows) in order;
    None where no chunk runs with an adapter. A name not in `adapters` runs on the base
    model (`ModelRunner._step_adapters` says when)."""
    if all(name is None or name not in adapters for name, _ in chunks):
        return None
    ranges: dict[str, list[tuple[int, int]]] = {}
    row = 0
    for name, length in chunks:
        if name is not None and name in adapters:
            runs = ranges.setdefault(name, [])
            if runs and runs[-1][1] == row:
                runs[-1] = (runs[-1][0], row + length)
            else:
                runs.append((row, row + length))
        row += length
    groups: list[tuple[LoraAdapter, slice | torch.Tensor]] = []
    for name, runs in ranges.items():
        adapter = adapters[name]
        if len(runs) == 1:
            groups.append((adapter, slice(*runs[0])))
        else:
            rows = [r for start, end in runs for r in range(start, end)]
            groups.append((adapter, torch.tensor(rows, device=device)))
    return LoraRows(tuple(groups))
