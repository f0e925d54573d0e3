"""The Triton paged-decode kernel against the torch reference.

Without a GPU the kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`) on CPU
tensors: that checks its indexing, masking, grouped-query mapping and online softmax,
not its compiled code. The `cuda` tests run the compiled kernel and are skipped, with
their reason, where no CUDA device is present.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from kvscope.kernels.attention import (
    build_metadata,
    decode_backend,
    paged_attention,
    reference_decode,
)
from kvscope.kernels.cpu_decode import CpuDecode

pytest.importorskip("triton", reason="triton is not installed (pip install 'kvscope[cuda]')")

MODULE = "kvscope.kernels.triton_attention"
NO_CUDA = "no CUDA device here: the Triton kernel was checked only under the interpreter"

# (heads, kv_heads, head_dim, block_size): GQA, MHA, MQA, and sizes that are not
# powers of two (padded and masked inside the kernel).
SHAPES = [(8, 2, 16, 16), (4, 4, 32, 8), (6, 1, 24, 5), (12, 4, 64, 16)]


@pytest.fixture
def interpreted() -> Iterator[ModuleType]:
    """The kernel module imported under the interpreter (see conftest.py)."""
    try:
        from triton import knobs

        interpret = bool(knobs.runtime.interpret)
    except ImportError:  # triton < 3.4 has no knobs
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpret:
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 could be set (or a GPU is present)"
        )
    sys.modules.pop(MODULE, None)
    try:
        yield importlib.import_module(MODULE)
    finally:
        sys.modules.pop(MODULE, None)


def random_case(
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    num_blocks, batch = 40, 5
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 2, 7 * block_size])
    width = int(-(-lens.max() // block_size))
    # Distinct, shuffled block ids per row; rows shorter than the widest padded with 0.
    perm = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width)
    used = -(-lens // block_size)
    tables = torch.where(torch.arange(width)[None, :] < used[:, None], perm, 0)
    query = torch.randn(batch, heads, dim, generator=gen)
    keys = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    values = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    to = dict(device=device, dtype=dtype)
    return query.to(**to), keys.to(**to), values.to(**to), tables.to(device), lens.to(device)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_interpreted_kernel_matches_reference(
    interpreted: ModuleType, shape: tuple[int, ...]
) -> None:
    query, keys, values, tables, lens = random_case(*shape)
    scale = shape[2] ** -0.5
    out = interpreted.paged_decode(query, keys, values, tables, lens, scale)
    ref = reference_decode(query, keys, values, tables, lens, scale)
    assert out.shape == ref.shape and out.dtype == query.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_interpreted_kernel_in_bfloat16(interpreted: ModuleType) -> None:
    query, keys, values, tables, lens = random_case(8, 2, 16, 16, dtype=torch.bfloat16)
    out = interpreted.paged_decode(query, keys, values, tables, lens, 0.25)
    ref = reference_decode(query.float(), keys.float(), values.float(), tables, lens, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_interpreted_kernel_reads_a_cache_written_by_paged_attention(
    interpreted: ModuleType,
) -> None:
    """Through `build_metadata` and the cache layout the model uses: two decode rows."""
    heads, kv_heads, dim, block_size = 4, 2, 16, 4
    gen = torch.Generator().manual_seed(1)
    key_cache = torch.zeros(16, block_size, kv_heads, dim)
    value_cache = torch.zeros_like(key_cache)
    starts, tables = [6, 9], [[3, 7], [5, 1, 12]]
    # Fill the cache with the earlier tokens of both sequences, as prefill would have.
    for start, table in zip(starts, tables, strict=True):
        meta = build_metadata(
            starts=[0],
            lengths=[start],
            block_tables=[table],
            block_size=block_size,
            device=torch.device("cpu"),
        )
        paged_attention(
            torch.randn(start, heads, dim, generator=gen),
            torch.randn(start, kv_heads, dim, generator=gen),
            torch.randn(start, kv_heads, dim, generator=gen),
            key_cache,
            value_cache,
            meta,
            0.25,
        )
    meta = build_metadata(
        starts=starts,
        lengths=[1, 1],
        block_tables=tables,
        block_size=block_size,
        device=torch.device("cpu"),
    )
    query = torch.randn(2, heads, dim, generator=gen)
    key, value = (
        torch.randn(2, kv_heads, dim, generator=gen),
        torch.randn(2, kv_heads, dim, generator=gen),
    )
    expected = paged_attention(query, key, value, key_cache, value_cache, meta, 0.25).view(
        2, heads, dim
    )
    assert meta.decode_tables is not None and meta.decode_context_lens is not None
    out = interpreted.paged_decode(
        query, key_cache, value_cache, meta.decode_tables, meta.decode_context_lens, 0.25
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_cuda_tensors_dispatch_to_triton() -> None:
    decode_backend.cache_clear()
    try:
        assert decode_backend("cuda").__module__ == MODULE
        cpu = decode_backend("cpu")  # the compiled CPU kernel, over the reference
        assert isinstance(cpu, CpuDecode) and cpu.fallback is reference_decode
    finally:
        decode_backend.cache_clear()


def test_reference_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCOPE_ATTENTION", "reference")
    decode_backend.cache_clear()
    try:
        assert decode_backend("cuda") is reference_decode
    finally:
        decode_backend.cache_clear()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_compiled_kernel_matches_reference_on_cuda(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    sys.modules.pop(MODULE, None)
    from kvscope.kernels.triton_attention import paged_decode

    query, keys, values, tables, lens = random_case(*shape, device="cuda", dtype=dtype)
    scale = shape[2] ** -0.5
    out = paged_decode(query, keys, values, tables, lens, scale)
    ref = reference_decode(query.float(), keys.float(), values.float(), tables, lens, scale)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_on_cuda_gives_the_cpu_tokens() -> None:
    from kvscope import Engine

    tokens = {}
    for device in ("cpu", "cuda"):
        async with Engine.open(
            "tiny-random", device=device, dtype="float32", num_kv_blocks=64
        ) as engine:
            out = await engine.generate(
                "Once upon a time", temperature=0, max_tokens=32, ignore_eos=True
            )
            tokens[device] = out.token_ids
    assert tokens["cuda"] == tokens["cpu"]
