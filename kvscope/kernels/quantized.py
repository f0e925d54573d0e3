"""Quantized weights as GGUF files hold them, kept quantized in memory.

`QuantizedWeight` is the one type that crosses from the model files (`models/gguf*.py`,
which read a GGUF tensor and build one) to the kernels that multiply it: the GGML block
type by name (`"Q4_1"`, `"Q8_0"`, `"Q4_K"`, ...), the logical shape `(out_features,
in_features)` as a linear layer sees it, and the raw blocks, one row of the weight per
row of `data` (each row is quantized on its own, so a row range is a view and a row
permutation is a row gather, whatever the type).
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["QuantizedWeight"]


@attrs.frozen
class QuantizedWeight:
    """A `(out_features, in_features)` weight in GGML blocks: `data` is uint8,
    `(out_features, row_bytes)`, contiguous, each row the blocks of one output feature."""

    qtype: str
    shape: tuple[int, int]
    data: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]
