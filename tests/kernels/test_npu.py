"""The Ascend decode path's dispatch and fallback logic.

There is no Ascend NPU here, so `FakeTorchNpu` STANDS IN FOR THE HARDWARE: a module
injected as `torch_npu` whose fused ops compute attention with the torch reference and
record how they were called. These tests check that kvscope picks the right op, passes
it the cache in the layout torch_npu documents, and falls back to the reference when
torch_npu, the op, or the call is missing or fails. They say nothing about the real
kernels' numerics, which have not been run on Ascend hardware in this project.
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types
from typing import Any

import pytest
import torch

from kvscope.kernels import device as device_module
from kvscope.kernels.attention import decode_backend, reference_decode
from kvscope.kernels.npu import NpuDecode


class FakeTorchNpu(types.ModuleType):
    """A fake `torch_npu` (no Ascend hardware here): fused ops run the torch reference."""

    def __init__(
        self,
        *,
        ops: tuple[str, ...] = ("npu_fused_infer_attention_score",),
        scale_key: str = "scale",
        fail: bool = False,
    ) -> None:
        super().__init__("torch_npu")
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._scale_key, self._fail = scale_key, fail
        for name in ops:
            setattr(self, name, self._op(name))

    def _op(self, name: str) -> Any:
        def op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
            if self._scale_key not in kwargs:
                raise TypeError(f"{name}() got an unexpected keyword argument")
            self.calls.append((name, kwargs))
            if self._fail:
                raise RuntimeError("EZ9999: fake device failure")
            assert kwargs["input_layout"] == "BSH" and kwargs["block_table"].dtype == torch.int32
            heads, kv_heads = kwargs["num_heads"], kwargs["num_key_value_heads"]
            batch, blocks, block_size = query.shape[0], key.shape[0], kwargs["block_size"]
            dim = query.shape[-1] // heads
            lens = kwargs[
                "actual_seq_lengths_kv"
                if name == "npu_fused_infer_attention_score"
                else "actual_seq_lengths"
            ]
            out = reference_decode(
                query.view(batch, heads, dim),
                key.view(blocks, block_size, kv_heads, dim),
                value.view(blocks, block_size, kv_heads, dim),
                kwargs["block_table"].long(),
                torch.tensor(lens),
                kwargs[self._scale_key],
            ).reshape(batch, 1, heads * dim)
            return (out, torch.empty(0)) if name == "npu_fused_infer_attention_score" else out

        return op


def case(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(3, 8, 16, generator=gen)
    keys = torch.randn(12, 4, 2, 16, generator=gen)
    values = torch.randn(12, 4, 2, 16, generator=gen)
    tables = torch.tensor([[5, 0, 0], [2, 9, 0], [1, 3, 11]])
    lens = torch.tensor([3, 6, 12])
    return query, keys, values, tables, lens


def run(decode: NpuDecode) -> torch.Tensor:
    out = decode(*case(), 0.25)
    torch.testing.assert_close(out, reference_decode(*case(), 0.25))
    return out


def fake_loader(fake: FakeTorchNpu | None) -> Any:
    return lambda: fake


def never_called(*args: Any) -> torch.Tensor:
    raise AssertionError("the fallback was used although a fused op works")


def test_prefers_fused_infer_attention_score() -> None:
    fake = FakeTorchNpu(ops=("npu_incre_flash_attention", "npu_fused_infer_attention_score"))
    decode = NpuDecode(never_called, loader=fake_loader(fake))
    run(decode)
    assert decode.op_name == "npu_fused_infer_attention_score"
    name, kwargs = fake.calls[0]
    assert name == "npu_fused_infer_attention_score"
    assert kwargs["actual_seq_lengths_kv"] == [3, 6, 12] and kwargs["block_size"] == 4
    assert kwargs["num_heads"] == 8 and kwargs["num_key_value_heads"] == 2


def test_older_incre_flash_attention_with_scale_value() -> None:
    fake = FakeTorchNpu(ops=("npu_incre_flash_attention",), scale_key="scale_value")
    decode = NpuDecode(never_called, loader=fake_loader(fake))
    run(decode)
    run(decode)
    assert decode.op_name == "npu_incre_flash_attention"
    assert [name for name, _ in fake.calls] == ["npu_incre_flash_attention"] * 2


def test_no_fused_op_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    decode = NpuDecode(reference_decode, loader=fake_loader(FakeTorchNpu(ops=())))
    with caplog.at_level(logging.WARNING):
        run(decode)
    assert decode.op_name is None and "torch_npu has none of" in caplog.text


def test_missing_torch_npu_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # `import torch_npu` raises ImportError
    decode = NpuDecode(reference_decode)
    run(decode)
    assert decode.op_name is None


def test_failing_op_falls_back_for_good(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeTorchNpu(fail=True)
    decode = NpuDecode(reference_decode, loader=fake_loader(fake))
    with caplog.at_level(logging.WARNING):
        run(decode)
        run(decode)
    assert len(fake.calls) == 1 and decode.op_name is None
    assert "EZ9999" in caplog.text


def test_npu_tensors_dispatch_to_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    decode_backend.cache_clear()
    try:
        decode = decode_backend("npu")
        assert isinstance(decode, NpuDecode)
        run(decode)
        assert decode.op_name == "npu_fused_infer_attention_score" and fake.calls
    finally:
        decode_backend.cache_clear()


def fake_torch(npu_present: bool) -> Any:
    """`torch` as device.py sees it once torch_npu is imported: `torch.npu` exists and
    "npu" is a device type (the real torch_npu registers it; the fake cannot)."""
    return types.SimpleNamespace(
        npu=types.SimpleNamespace(is_available=lambda: npu_present),
        cuda=types.SimpleNamespace(is_available=lambda: False),
        device=lambda name: f"device({name})",
    )


def test_auto_device_picks_an_available_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", FakeTorchNpu())
    monkeypatch.setattr(device_module, "torch", fake_torch(True))
    assert device_module.select_device("auto") == "device(npu)"
    assert device_module.select_device("npu:1") == "device(npu:1)"
    monkeypatch.setattr(device_module, "torch", fake_torch(False))
    assert device_module.select_device("auto") == "device(cpu)"
    with pytest.raises(ValueError, match="torch_npu or an Ascend device is missing"):
        device_module.select_device("npu")


def test_without_torch_npu_npu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert not device_module.npu_available()
    with pytest.raises(ValueError, match="device 'npu:0' asked for"):
        device_module.select_device("npu:0")
