"""The Ascend NPU decode path: torch_npu's fused attention over the paged cache, with
the torch reference as the fallback.

`NpuDecode` is a decode function with the reference's signature (see `attention.py`).
On its first call it imports `torch_npu` (lazily: it is an optional extra) and picks the
first fused op that exists:

1. `torch_npu.npu_fused_infer_attention_score` (CANN 8 / torch_npu 2.1+), and
2. `torch_npu.npu_incre_flash_attention` (older releases),

each called in the "BSH" layout with the cache viewed as
`[num_blocks, block_size, kv_heads * dim]`, the block table as int32 and the context
lengths as `actual_seq_lengths(_kv)`. The softmax scale keyword was renamed from
`scale_value` to `scale` between releases; both spellings are tried. If no op exists,
or an op raises (an unsupported dtype, head size or release), the reason is logged
once and every later call uses the torch reference, so serving goes on.

Prefill chunks use the reference's `scaled_dot_product_attention`, which torch_npu
implements. None of this has run on Ascend hardware in this project yet: the tests
drive it with a fake `torch_npu` module (see docs/devices.md).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

Decode = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]

#: Fused ops in order of preference.
FUSED_OPS = ("npu_fused_infer_attention_score", "npu_incre_flash_attention")


def import_torch_npu() -> Any | None:
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        return None


class NpuDecode:
    """Decode attention on Ascend: a fused torch_npu op, else `fallback`."""

    def __init__(
        self, fallback: Decode, *, loader: Callable[[], Any | None] = import_torch_npu
    ) -> None:
        self.fallback = fallback
        self._loader = loader
        self._resolved = False
        self.op_name: str | None = None  # the fused op in use; None: the fallback
        self._op: Callable[..., Any] | None = None
        self._scale_key = "scale"

    def _resolve(self) -> None:
        self._resolved = True
        torch_npu = self._loader()
        if torch_npu is None:
            log.warning("torch_npu is not importable; NPU decode uses the torch reference")
            return
        for name in FUSED_OPS:
            op = getattr(torch_npu, name, None)
            if callable(op):
                self.op_name, self._op = name, op
                log.info("NPU decode uses torch_npu.%s", name)
                return
        log.warning(
            "torch_npu has none of %s; NPU decode uses the torch reference", ", ".join(FUSED_OPS)
        )

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        if not self._resolved:
            self._resolve()
        if self._op is None:
            return self.fallback(query, key_cache, value_cache, block_tables, context_lens, scale)
        try:
            return self._fused(query, key_cache, value_cache, block_tables, context_lens, scale)
        except Exception as exc:  # any failure of the device op: fall back for good
            log.warning(
                "torch_npu.%s failed (%r); NPU decode falls back to the torch reference",
                self.op_name,
                exc,
            )
            self.op_name, self._op = None, None
            return self.fallback(query, key_cache, value_cache, block_tables, context_lens, scale)

    def _fused(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        assert self._op is not None
        batch, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        kwargs: dict[str, Any] = dict(
            num_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            input_layout="BSH",
            block_table=block_tables.to(torch.int32),
            block_size=block_size,
        )
        lengths = [int(n) for n in context_lens.tolist()]
        if self.op_name == "npu_fused_infer_attention_score":
            kwargs["actual_seq_lengths_kv"] = lengths
        else:
            kwargs["actual_seq_lengths"] = lengths
        args = (
            query.reshape(batch, 1, num_heads * head_dim).contiguous(),
            key_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            value_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
        )
        try:
            result = self._op(*args, **kwargs, **{self._scale_key: scale})
        except TypeError:
            # Older releases name the scale `scale_value`; newer ones `scale`.
            other = "scale_value" if self._scale_key == "scale" else "scale"
            result = self._op(*args, **kwargs, **{other: scale})
            self._scale_key = other
        out = result[0] if isinstance(result, tuple | list) else result
        return out.reshape(batch, num_heads, head_dim)
