"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the paged KV cache.

One forward runs a mixed batch (decode tokens and prefill chunks, laid out flat as
`kernels.attention` describes) and returns the hidden states; `logits` turns the rows
that sample into float32 logits. The norms are plain tensors; q/k/v and gate/up are
fused into one matrix each so a layer is four matrix multiplies, each a
`kernels.linear.Linear` in the layout that is fastest on the device; `check_weights`
(`models/weights.py`) validates a checkpoint's tensors against the config before any
is copied. A linear
weight may come quantized (`kernels.quantized.QuantizedWeight`, from a GGUF file): it
stays so, fused with its partners where they share its block type, and dequantized
where they do not (the embedding table too, which is read a row at a time).

The forward calls a `checkpoint` hook at fixed points. Given the batch (before each
layer's attention, right after its q/k/v projection; before its MLP; after the last
layer), the hook may drop rows: the runner drops those of sequences cancelled while
the step runs, so the rest of the forward neither computes nor touches their KV blocks,
and raises `StepAborted` when nobody is left. Given a `LinearSlicer`, the forward also
cuts every long linear layer into column pieces and calls the hook with None between
them and after the attention (`kernels/slicing.py`): there rows cannot leave the batch,
but a cancelled sequence's blocks may be released at once, since no KV block is read or
written before the next checkpoint that is given the batch, where its rows leave.

Numerics follow Hugging Face `transformers` (RMSNorm in float32, rotary tables in
float32 cast to the activations' dtype) so greedy tokens match it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs
import torch
import torch.nn.functional as F

from kvscope.cache.kv_cache import KVCache
from kvscope.kernels import fused_layer, linear
from kvscope.kernels.attention import AttentionMetadata, paged_attention
from kvscope.kernels.fused import rms_norm, rope_and_cache, silu_and_mul
from kvscope.kernels.linear import Linear
from kvscope.kernels.quantized import QuantizedWeight
from kvscope.kernels.rope import apply_rotary, rotary_tables
from kvscope.kernels.slicing import LinearSlicer

from .config import ModelConfig
from .lora import LoraAdapter, LoraRows
from .weights import Weight, WeightReader, check_weights


class StepAborted(Exception):
    """Every sequence of the running step was cancelled; the forward stopped early."""


@attrs.define
class LayerBatch:
    """What flows through the layers; a `checkpoint` may shrink it (drop rows)."""

    hidden: torch.Tensor  # [tokens, hidden]
    cos: torch.Tensor  # [tokens, head_dim]
    sin: torch.Tensor
    meta: AttentionMetadata
    qkv: torch.Tensor | None = None  # [tokens, q + k + v], at the checkpoint before attention
    lora: LoraRows | None = None  # the rows that run with a LoRA adapter (`models/lora.py`)


#: Called with the batch where rows may leave it, with None where they may not.
Checkpoint = Callable[[LayerBatch | None], None]


@attrs.define
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # q, k and v fused (with their bias on Qwen2)
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # gate and up fused
    down: Linear

    def fusable(self) -> tuple[torch.Tensor, Linear, Linear, torch.Tensor, Linear, Linear]:
        """What `kernels.fused_layer.fused_layer` takes, in its order."""
        return self.input_norm, self.qkv, self.o_proj, self.post_norm, self.gate_up, self.down


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, Weight],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5
        #: What a fused layer needs of the config (`kernels/fused_layer.py`).
        self.shape = (c.num_heads, c.rms_norm_eps, self.scale)

        check_weights(config, weights)

        read = WeightReader(weights, dtype, device)
        take, linear_of = read.tensor, read.linear
        self.embed = take("model.embed_tokens.weight")
        self.final_norm = take("model.norm.weight")
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        # A tied head shares the embedding's tensor, unless that is quantized: then the
        # head multiplies the quantized blocks (a quarter to half the bytes a token).
        tied = c.tie_word_embeddings and not isinstance(weights[head], QuantizedWeight)
        self.lm_head = Linear(self.embed) if tied else linear_of(head)
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            bias = None
            if c.attention_bias:
                bias = torch.cat([take(attn + f"{n}_proj.bias") for n in "qkv"])
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=linear_of(*(attn + f"{n}_proj.weight" for n in "qkv"), bias=bias),
                    q_norm=take(attn + "q_norm.weight") if c.qk_norm else None,
                    k_norm=take(attn + "k_norm.weight") if c.qk_norm else None,
                    o_proj=linear_of(attn + "o_proj.weight"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=linear_of(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                    down=linear_of(mlp + "down_proj.weight"),
                )
            )
        #: Which weight layouts the linear layers use (`kernels.linear.plan`).
        self.linear_layout = linear.plan(self.linears())
        #: Each layer in one compiled call for decode steps, where it can be
        #: (`kernels/fused_layer.py`); None where it cannot (q/k norms: Qwen3).
        self.fused = [
            None if layer.q_norm is not None else fused_layer.fused_layer(*layer.fusable())
            for layer in self.layers
        ]
        #: The LoRA adapters requests may run with, by name (`models/lora.py`).
        self.adapters: dict[str, LoraAdapter] = {}
        self.released = False
        self.cos, self.sin = rotary_tables(
            c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings, device
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        checkpoint: Checkpoint | None = None,
        slicer: LinearSlicer | None = None,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        if self.released:
            raise RuntimeError("this copy of the model released its weights (release_weights)")
        batch = LayerBatch(
            F.embedding(input_ids, self.embed),
            self.cos[positions].to(self.dtype),
            self.sin[positions].to(self.dtype),
            meta,
            lora=lora,
        )
        between = _between(checkpoint, slicer)
        fused = self._fused_layers(batch, slicer)
        for index, (layer, compiled) in enumerate(zip(self.layers, fused, strict=True)):
            caches = kv_cache.keys[index], kv_cache.values[index]
            if compiled is not None:
                if checkpoint is not None:
                    checkpoint(batch)  # before the layer's KV blocks are touched
                compiled.run(batch.hidden, batch.cos, batch.sin, batch.meta, caches, self.shape)
                continue
            self._attention_block(index, layer, batch, caches, checkpoint, slicer)
            if checkpoint is not None:
                checkpoint(batch)  # halfway through the layer: the MLP is half its time
            self._mlp_block(index, layer, batch, slicer, between)
            if between is not None and index + 1 < len(self.layers):
                between()  # (after the last layer, the checkpoint below follows at once)
        if checkpoint is not None:
            checkpoint(batch)  # the rows returned are those still wanted
        return rms_norm(batch.hidden, self.final_norm, self.config.rms_norm_eps)

    def _fused_layers(
        self, batch: LayerBatch, slicer: LinearSlicer | None
    ) -> list[fused_layer.FusedLayer | None]:
        """Each layer's compiled form where this step runs it in one call
        (`kernels/fused_layer.py`; with `slicer`, where a whole layer fits in the
        checkpoint gap), else None: the step-by-step blocks."""
        if batch.lora is not None:
            return [None] * len(self.layers)
        rows = batch.hidden.shape[0]
        fits = None if slicer is None else (lambda linears: slicer.within_target(linears, rows))
        return fused_layer.choose(self.fused, batch.meta, batch.hidden, fits)

    def _attention_block(
        self,
        index: int,
        layer: LayerWeights,
        batch: LayerBatch,
        caches: tuple[torch.Tensor, torch.Tensor],
        checkpoint: Checkpoint | None,
        slicer: LinearSlicer | None,
    ) -> None:
        """`batch.hidden += o_proj(attention(qkv(rms_norm(hidden))))`, writing the
        layer's K/V into its cache blocks (`caches`)."""
        c, eps = self.config, self.config.rms_norm_eps
        between = _between(checkpoint, slicer)
        x = rms_norm(batch.hidden, layer.input_norm, eps)
        batch.qkv = _linear(layer.qkv, x, slicer, between)
        if batch.lora is not None:
            batch.lora.apply(index, "qkv", x, batch.qkv)
        if checkpoint is not None:
            checkpoint(batch)  # the last one before this layer's KV blocks are touched
        hidden, qkv, cos, sin = batch.hidden, batch.qkv, batch.cos, batch.sin
        batch.qkv = None
        num_tokens = hidden.shape[0]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        v = v.view(num_tokens, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            q = rms_norm(q.view(num_tokens, c.num_heads, c.head_dim), layer.q_norm, eps)
            k = rms_norm(k.view(num_tokens, c.num_kv_heads, c.head_dim), layer.k_norm, eps)
            qk = torch.cat([q, k], dim=1)
        # q and k heads rotated together: one set of ops for both (on the CPU, one
        # pass that also writes k and v into the cache).
        qk = qk.view(num_tokens, -1, c.head_dim)
        keys, values = caches
        written = rope_and_cache(qk, v, cos, sin, batch.meta.slot_mapping, keys, values)
        if not written:
            qk = apply_rotary(qk, cos, sin)
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        attended = paged_attention(
            q, k, v, keys, values, batch.meta, self.scale, written=written,
            slicing=None if slicer is None else slicer.attention, between=between,
        )  # fmt: skip
        if between is not None:
            between()
        projected = _linear(layer.o_proj, attended, slicer, between)
        if batch.lora is not None:
            batch.lora.apply(index, "o_proj", attended, projected)
        batch.hidden = hidden + projected

    def _mlp_block(
        self,
        index: int,
        layer: LayerWeights,
        batch: LayerBatch,
        slicer: LinearSlicer | None,
        between: Callable[[], None] | None,
    ) -> None:
        """`batch.hidden += down(silu(gate) * up)(rms_norm(hidden))`."""
        hidden = batch.hidden
        x = rms_norm(hidden, layer.post_norm, self.config.rms_norm_eps)
        if batch.lora is not None and batch.lora.adapts(index, "gate_up", "down"):
            # The adapted MLP unfused: each adapter adds to gate/up before the
            # activation and to down after it.
            gate_up = _linear(layer.gate_up, x, slicer, between)
            activated = silu_and_mul(batch.lora.apply(index, "gate_up", x, gate_up))
            down = _linear(layer.down, activated, slicer, between)
            batch.hidden = hidden + batch.lora.apply(index, "down", activated, down)
        elif slicer is not None:
            batch.hidden = slicer.gated_mlp(layer.gate_up, layer.down, x, hidden, between)
        else:
            batch.hidden = hidden + layer.down(silu_and_mul(layer.gate_up(x)))

    def logits(
        self,
        hidden: torch.Tensor,
        checkpoint: Checkpoint | None = None,
        slicer: LinearSlicer | None = None,
    ) -> torch.Tensor:
        """Float32 logits of `hidden`'s rows; `checkpoint` may release, not drop, rows."""
        if slicer is None:
            return self.lm_head(hidden).float()
        return slicer(self.lm_head, hidden, _between(checkpoint, slicer)).float()

    def linears(self) -> list[Linear]:
        """Every linear layer, the output head first."""
        linears = [self.lm_head]
        for layer in self.layers:
            linears += [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
        return linears

    def weight_bytes(self) -> int:
        """The memory this copy of the model holds: its weights, the linear layers'
        float32 and prepacked copies, and the rotary tables."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def release_weights(self) -> None:
        """Free every weight (a model worker process holds its own copy); this copy
        cannot run a forward again."""
        self.layers, self.fused = [], []
        self.embed = self.final_norm = self.cos = self.sin = torch.empty(0, dtype=self.dtype)
        self.lm_head = Linear(self.embed)
        self.adapters = {}
        self.released = True

    def _tensors(self) -> list[torch.Tensor]:
        """Each tensor this copy holds once: the weights (a quantized one's blocks), the
        layouts `plan` added, the rotary tables and the adapters."""
        tensors = [self.embed, self.final_norm, self.cos, self.sin]
        linears = [self.lm_head]  # (tied, its weight is the embedding: counted once)
        for layer in self.layers:
            for t in attrs.astuple(layer, recurse=False):
                if isinstance(t, Linear):
                    linears.append(t)
                elif t is not None:
                    tensors.append(t)
        for lin in linears:
            tensors += lin.tensors()
            tensors += [
                w for w in (lin.packed, lin.wide, lin.wide_packed, lin.wide_bias) if w is not None
            ]
        tensors += [t for adapter in self.adapters.values() for t in adapter.tensors()]
        return list({id(t): t for t in tensors}.values())


def _between(
    checkpoint: Checkpoint | None, slicer: LinearSlicer | None
) -> Callable[[], None] | None:
    """The hook for the points where rows cannot leave the batch (slicing only)."""
    if checkpoint is None or slicer is None:
        return None
    return lambda: checkpoint(None)


def _linear(
    weights: Linear,
    x: torch.Tensor,
    slicer: LinearSlicer | None,
    between: Callable[[], None] | None,
) -> torch.Tensor:
    """`weights(x)`, in column pieces with `between()` after each where `slicer` cuts it."""
    return slicer(weights, x, between) if slicer is not None else weights(x)
