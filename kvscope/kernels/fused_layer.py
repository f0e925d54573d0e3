"""A decoder layer of decode rows in one compiled call (`csrc/decode_layer.cpp`).

At one stream of a small model a layer's kernels are quick (SmolLM2-135M in Q4_1: ~0.15
ms a layer) and the Python between them, ~15 calls each with its checks and
allocations, cost as much again: 13.6 ms a token in-process, 8 of them in kernels. The
compiled `decode_layer` runs the same kernels in the same order with the same roundings
(rms_norm, the q/k/v multiply, rope and the cache write, paged decode attention, the
output projection and its residual, the gated MLP and its residual), so a layer's
result is equal to the bit to the forward's step-by-step path (`check`, run once when
the library has loaded, before the first fused layer serves).

A layer is fused (`FusedLayer.takes`) only where every one of its linears would take a
compiled path at this row count anyway: a GGML-quantized weight of a compiled type
through the integer dot kernel (up to `quantized.DOT_ROWS` rows), or a prepacked
bfloat16 weight through `small_linear` (up to `linear.SMALL_ROWS`); the step holds
decode rows only; the decode attention is the compiled kernel; no LoRA row, no q/k
norm (Qwen3). Everything else keeps the step-by-step path, which stays the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import attrs
import torch

from .attention import AttentionMetadata, decode_backend
from .cpu_decode import DTYPES, CpuDecode, cpu_kernel
from .ggml_quants import COMPILED_TYPES, random_blocks
from .linear import SMALL_ROWS, Linear
from .quantized import DOT_ROWS

log = logging.getLogger(__name__)


@attrs.frozen
class FusedLayer:
    """One layer's weights as `decode_layer` takes them, and the rows it serves up to."""

    weights: list[torch.Tensor]  # input_norm, qkv, o, post_norm, gate_up, down
    qtypes: list[str]  # qkv, o, gate_up, down: a GGML block type, "" for small_linear
    qkv_bias: torch.Tensor | None
    max_rows: int
    linears: list[Linear]  # qkv, o, gate_up, down
    quantized: bool  # some linear multiplies quantized blocks
    plain: bool  # some linear is a bfloat16 weight for small_linear
    #: What whether a step takes it, and its cost, depend on: its weights' types and
    #: shapes (layers alike share one answer a step, `choose`).
    key: tuple[object, ...]

    def takes(self, rows: int, meta: AttentionMetadata, hidden: torch.Tensor) -> bool:
        """Whether a step of `rows` decode rows of `hidden` runs fused (see the module)."""
        if not 0 < rows <= self.max_rows or meta.num_decode != rows or meta.prefills:
            return False
        if hidden.dtype not in DTYPES or (self.plain and hidden.dtype != torch.bfloat16):
            return False
        return hidden.is_contiguous() and decode_layer_op(self) is not None

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        caches: tuple[torch.Tensor, torch.Tensor],
        shape: tuple[int, float, float],
    ) -> None:
        """One layer over `hidden` ([rows, hidden], updated in place); `shape` is the
        number of query heads, the norms' epsilon and the attention's scale."""
        op = decode_layer_op(self)
        assert op is not None, "see FusedLayer.takes"
        num_heads, eps, scale = shape
        bias = self.qkv_bias
        if bias is not None and bias.dtype != hidden.dtype:
            bias = bias.to(hidden.dtype)
        op(
            hidden,
            self.weights,
            self.qtypes,
            bias,
            cos,
            sin,
            meta.slot_mapping,
            caches[0],
            caches[1],
            meta.decode_tables,
            meta.decode_context_lens,
            num_heads,
            eps,
            scale,
        )


def fused_layer(
    input_norm: torch.Tensor,
    qkv: Linear,
    o_proj: Linear,
    post_norm: torch.Tensor,
    gate_up: Linear,
    down: Linear,
) -> FusedLayer | None:
    """The layer as `decode_layer` takes it; None where a linear has no compiled path
    (another layout, a block type the library lacks) or takes a bias it cannot add."""
    weights, qtypes, limits = [], [], []
    for linear in (qkv, o_proj, gate_up, down):
        quantized = linear.quantized
        if quantized is not None:
            if quantized.qtype not in COMPILED_TYPES or quantized.data.device.type != "cpu":
                return None
            weights.append(quantized.data)
            qtypes.append(quantized.qtype)
            limits.append(DOT_ROWS)
        elif linear.packed is not None:
            assert isinstance(linear.weight, torch.Tensor) and linear.weight.is_contiguous()
            weights.append(linear.weight)
            qtypes.append("")
            limits.append(SMALL_ROWS)
        else:
            return None
    if any(linear.bias is not None for linear in (o_proj, gate_up, down)):
        return None
    w_qkv, w_o, w_gate_up, w_down = weights
    layer_weights = [input_norm, w_qkv, w_o, post_norm, w_gate_up, w_down]
    return FusedLayer(
        weights=layer_weights,
        qtypes=qtypes,
        qkv_bias=qkv.bias,
        max_rows=min(limits),
        linears=[qkv, o_proj, gate_up, down],
        quantized=any(qtypes),
        plain=not all(qtypes),
        key=(*qtypes, *(tuple(w.shape) for w in layer_weights), qkv.bias is not None),
    )


def choose(
    layers: Sequence[FusedLayer | None],
    meta: AttentionMetadata,
    hidden: torch.Tensor,
    fits: Callable[[list[Linear]], bool] | None,
) -> list[FusedLayer | None]:
    """The layers a step of `hidden`'s rows runs fused (None for the others): those
    that `take` it and, given `fits`, whose linears it says fit in one checkpoint gap
    (both asked once for each kind of layer, `FusedLayer.key`)."""
    rows, usable = hidden.shape[0], {}
    chosen: list[FusedLayer | None] = []
    for layer in layers:
        if layer is not None and layer.key not in usable:
            takes = layer.takes(rows, meta, hidden)
            usable[layer.key] = takes and (fits is None or fits(layer.linears))
        chosen.append(layer if layer is not None and usable[layer.key] else None)
    return chosen


_checked: dict[str, Callable[..., None] | None] = {}


def decode_layer_op(layer: FusedLayer) -> Callable[..., None] | None:
    """The compiled `decode_layer` once the library has loaded with the ops `layer`
    needs and the op has passed `check`; None until then, and for good if it failed."""
    kernel = cpu_kernel()
    if kernel.op is None or not isinstance(decode_backend("cpu"), CpuDecode):
        return None
    if layer.quantized and kernel.quant_linear_op is None:
        return None
    if layer.plain and kernel.small_linear_op is None:
        return None
    if "op" not in _checked:
        _checked["op"] = _checked_op()
    return _checked["op"]


def _checked_op() -> Callable[..., None] | None:
    try:
        op = torch.ops.kvscope.decode_layer.default
        check(op)
    except Exception as exc:  # a stale or broken build: the step-by-step path serves
        log.warning("decode layers stay step by step: the fused op failed its check (%s)", exc)
        return None
    return op


def check(op: Callable[..., None]) -> None:
    """Raise unless `op` equals the library's ops run one by one, to the bit, on a random
    layer (Q8_0 weights, float32 and bfloat16 rows; bfloat16 weights where small_linear
    serves)."""
    kernel = cpu_kernel()
    generator = torch.Generator().manual_seed(0)
    cases: list[tuple[str, torch.dtype]] = []
    if kernel.quant_linear_op is not None:
        cases += [("Q8_0", torch.float32), ("Q8_0", torch.bfloat16)]
    if kernel.small_linear_op is not None:
        cases.append(("", torch.bfloat16))
    for qtype, dtype in cases:
        case = _CheckLayer(qtype, dtype, generator)
        fused = case.hidden.clone()
        keys, values = case.caches()
        op(
            fused,
            case.weights,
            [qtype] * 4,
            None,
            case.cos,
            case.sin,
            case.slots,
            keys,
            values,
            case.tables,
            case.lens,
            case.heads,
            1e-5,
            0.125,
        )
        stepwise = case.stepwise()
        if not torch.equal(fused, stepwise):
            error = (fused.float() - stepwise.float()).abs().max().item()
            raise RuntimeError(f"decode_layer ({qtype or 'bfloat16'}, {dtype}) off by {error:.1e}")


class _CheckLayer:
    """A random layer of 4 query heads over 2 KV heads of 32, hidden 128, MLP 256, two
    decode rows at positions 5 and 20 of blocks of 8."""

    heads, kv_heads, dim, hidden_size, intermediate, block = 4, 2, 32, 128, 256, 8

    def __init__(self, qtype: str, dtype: torch.dtype, generator: torch.Generator) -> None:
        self.qtype, self.dtype, self.generator = qtype, dtype, generator
        h, d = self.hidden_size, self.dim
        shapes = [((self.heads + 2 * self.kv_heads) * d, h), (h, self.heads * d),
                  (2 * self.intermediate, h), (h, self.intermediate)]  # fmt: skip
        linears = [self._weight(*shape) for shape in shapes]
        norms = [1 + 0.1 * self._rand(h) for _ in range(2)]
        self.weights = [norms[0], linears[0], linears[1], norms[1], linears[2], linears[3]]
        self.hidden = self._rand(2, h)
        angles = torch.rand(2, d // 2, generator=generator) * 6.28
        self.cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
        self.sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
        self.tables = torch.tensor([[3, 1, 0], [2, 5, 4]], dtype=torch.long)
        self.lens = torch.tensor([6, 21], dtype=torch.int32)
        self.slots = torch.tensor([3 * 8 + 5, 4 * 8 + 4], dtype=torch.long)
        self._cache = (
            self._rand(6, self.block, self.kv_heads, d),
            self._rand(6, self.block, self.kv_heads, d),
        )

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(self.dtype)

    def _weight(self, out_features: int, in_features: int) -> torch.Tensor:
        if self.qtype:
            return random_blocks(self.qtype, out_features, in_features, self.generator)
        return (0.05 * torch.randn(out_features, in_features, generator=self.generator)).to(
            self.dtype
        )

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache[0].clone(), self._cache[1].clone()

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
        kernel = cpu_kernel()
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        if self.qtype:
            assert kernel.quant_linear_op is not None
            kernel.quant_linear_op(out, x.contiguous(), weight, self.qtype, x.shape[1], None)
        else:
            assert kernel.small_linear_op is not None
            kernel.small_linear_op(out, x, weight, None)
        return out

    def stepwise(self) -> torch.Tensor:
        """The layer by the library's ops one call at a time."""
        k = cpu_kernel()
        assert k.rms_norm_op and k.rope_and_cache_op and k.op and k.silu_and_mul_op
        h, d, q_size, kv_size = (
            self.hidden_size,
            self.dim,
            self.heads * self.dim,
            self.kv_heads * self.dim,
        )
        norm1, w_qkv, w_o, norm2, w_gate_up, w_down = self.weights
        hidden = self.hidden.clone()
        keys, values = self.caches()
        x = torch.empty_like(hidden)
        k.rms_norm_op(x, hidden, norm1, 1e-5)
        qkv = self._linear(x, w_qkv, q_size + 2 * kv_size)
        qk = qkv[:, : q_size + kv_size].view(2, self.heads + self.kv_heads, d)
        v = qkv[:, q_size + kv_size :].view(2, self.kv_heads, d)
        k.rope_and_cache_op(qk, v, self.cos, self.sin, self.slots, keys, values)
        attended = torch.empty(2, self.heads, d, dtype=self.dtype)
        k.op(attended, qk[:, : self.heads], keys, values, self.tables, self.lens, 0.125)
        hidden = hidden + self._linear(attended.view(2, q_size), w_o, h)
        k.rms_norm_op(x, hidden, norm2, 1e-5)
        gate_up = self._linear(x, w_gate_up, 2 * self.intermediate)
        activated = torch.empty(2, self.intermediate, dtype=self.dtype)
        k.silu_and_mul_op(activated, gate_up)
        return hidden + self._linear(activated, w_down, h)
