"""GGML-quantized weights: the torch dequantization against the `gguf` package's own
(exactly), the compiled kernels against `F.linear` on the dequantized weight (within
`LINEAR_RTOL`) and the dot kernel against `quantized_reference` (the same 8-bit
activations: within float32 summation order) at SmolLM2-135M's shapes, in every
instruction-set build this CPU runs, the torch fallback with and without the library,
row views and stacking, and a few tensors of the real SmolLM2 GGUF file where it is here.

The compiled tests wait for the library (`cpu_library`) and skip without a compiler.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvscope.kernels import kernel_build, prebuilt
from kvscope.kernels.ggml_quants import (
    BLOCKS,
    DEQUANTIZE_RTOL,
    EXACT_RTOL,
    LINEAR_RTOL,
    check_quant_ops,
    quantized_reference,
    random_blocks,
)
from kvscope.kernels.quantized import (
    COMPILED_TYPES,
    DOT_ROWS,
    SUPPORTED_TYPES,
    QuantizedWeight,
    concat_rows,
    dequantize,
    dot_linear,
    quantized_linear,
    slab_linear,
)

REPO = Path(__file__).resolve().parents[2]
#: Types the gguf package quantizes in Python (the others get random raw blocks).
GGUF_QUANTIZES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
ROWS = (1, 2, 7, 64)


def odd_shape(qtype: str) -> tuple[int, int]:
    """(out, in): an odd number of outputs, an odd number of blocks a row."""
    return 37, 3 * max(BLOCKS[qtype].elems, 32)


def random_weight(qtype: str, out: int, k: int, seed: int = 0) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    return QuantizedWeight(qtype, (out, k), random_blocks(qtype, out, k, generator))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def gguf_dequantize(weight: QuantizedWeight) -> np.ndarray:
    values = gguf.quants.dequantize(weight.data.numpy(), gguf.GGMLQuantizationType[weight.qtype])
    return values.reshape(weight.shape)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES))
def test_dequantize_equals_gguf_on_random_blocks(qtype: str) -> None:
    weight = random_weight(qtype, 9, 512)
    assert np.array_equal(dequantize(weight).numpy(), gguf_dequantize(weight))


@pytest.mark.parametrize("qtype", GGUF_QUANTIZES)
def test_dequantize_equals_gguf_on_what_gguf_quantized(qtype: str) -> None:
    values = np.random.default_rng(1).standard_normal((6, 256)).astype(np.float32)
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
    data = torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8).reshape(6, -1))
    weight = QuantizedWeight(qtype, (6, 256), data)
    ours = dequantize(weight)
    assert np.array_equal(ours.numpy(), gguf_dequantize(weight))
    assert dequantize(weight, torch.bfloat16).equal(ours.bfloat16())
    assert (ours - torch.from_numpy(values)).abs().max() < 0.5  # it is the data, roughly


@pytest.fixture(scope="module")
def compiled(cpu_library) -> None:
    assert cpu_library.quant_linear_op is not None, "the quantized ops did not check out"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", sorted(COMPILED_TYPES))
def test_compiled_paths_match_f_linear(compiled, qtype: str, dtype: torch.dtype) -> None:
    """Both compiled designs, at each row count, with a bias: the integer dot kernel and
    the dequantized slabs (slabs of 5 rows, so several), and `quantized_linear`, which
    takes one of them."""
    out_features, k = odd_shape(qtype)
    weight = random_weight(qtype, out_features, k, seed=2)
    reference_weight = dequantize(weight)
    generator = torch.Generator().manual_seed(3)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=generator).to(dtype)
        expected = F.linear(x.float(), reference_weight, bias.float())
        dot = dot_linear(x, weight, bias)
        slabs = slab_linear(x, weight, bias, compiled=True, slab_values=5 * k)
        chosen = quantized_linear(x, weight, bias)
        assert dot.dtype == slabs.dtype == chosen.dtype == dtype
        assert relative_error(dot, expected) <= LINEAR_RTOL, (rows, "dot")
        assert relative_error(slabs, expected) <= (1e-5 if dtype == torch.float32 else 1e-2)
        one_slab = slab_linear(x, weight, bias, compiled=True)
        assert chosen.equal(dot if rows <= DOT_ROWS else one_slab)


#: SmolLM2-135M's linears as (out, in): q/k/v (576, 192, 64 after the split), fused
#: qkv, o, gate_up, down, lm_head; then rows of 1, 3 and 5 blocks (a kernel taking 4
#: blocks at a time has 1, 3 or 1 left, at every row and at the weight's end).
SMOLLM2_SHAPES = (
    (576, 576),
    (192, 576),
    (64, 576),
    (960, 576),
    (3072, 576),
    (576, 1536),
    (49152, 576),
    (37, 32),
    (37, 96),
    (37, 160),
)


def assert_exact(out: torch.Tensor, x: torch.Tensor, reference_weight, bias, what) -> None:
    expected = quantized_reference(x, reference_weight, bias)
    error = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert error <= EXACT_RTOL[out.dtype], (what, error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_the_dot_kernel_is_exact_at_smollm2_shapes(compiled, qtype: str, dtype) -> None:
    """The dot kernel at each row count it serves (1 to `DOT_ROWS`) on SmolLM2's shapes
    in both of its file's types, with a bias on odd row counts: what
    `quantized_reference` gives, but for the float32 sums' order."""
    generator = torch.Generator().manual_seed(7)
    for out_features, k in SMOLLM2_SHAPES:
        weight = random_weight(qtype, out_features, k, seed=out_features + k)
        reference_weight = dequantize(weight)
        for rows in range(1, DOT_ROWS + 1):
            x = torch.randn(rows, k, generator=generator).to(dtype)
            bias = torch.randn(out_features, generator=generator).to(dtype) if rows % 2 else None
            out = dot_linear(x, weight, bias)
            assert_exact(out, x, reference_weight, bias, (out_features, k, rows))


ISA_CHECK = """
import sys, torch
from kvscope.kernels.ggml_quants import check_quant_ops
torch.ops.load_library(sys.argv[1])
check_quant_ops(torch.ops.kvscope.quant_linear.default, torch.ops.kvscope.quant_dequantize.default)
print("checked")
"""


@pytest.mark.slow
def test_every_instruction_set_build_passes_the_load_check(tmp_path: Path, cpu_library) -> None:
    """`quant_matmul.cpp` alone, built for each prebuilt variant this CPU runs (AVX-512
    with VNNI, without it, AVX2: each its own vector path), passes the check a library
    passes at load, which holds the multiply to `quantized_reference`."""
    from concurrent.futures import ThreadPoolExecutor

    flags = set(kernel_build.cpu_flags_line().split())
    variants = [v for v in prebuilt.VARIANTS if v.needs <= flags]
    cxx = kernel_build.compiler()
    assert cxx is not None and variants

    def build(variant: prebuilt.Variant) -> Path:
        path = tmp_path / f"{variant.name}.so"
        source = kernel_build.CSRC / "quant_matmul.cpp"
        command = kernel_build.build_command(cxx, [source], path, march=variant.march)
        subprocess.run(command, check=True, capture_output=True, timeout=600)
        return path

    with ThreadPoolExecutor(2) as pool:
        libraries = list(pool.map(build, variants))
    for variant, library in zip(variants, libraries, strict=True):
        result = subprocess.run(
            [sys.executable, "-c", ISA_CHECK, str(library)],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0 and "checked" in result.stdout, (variant.name, result.stderr)


def test_compiled_dequantize_gives_the_torch_weight(compiled) -> None:
    """The slabs the compiled path multiplies are the weight torch dequantizes (equal
    here; within float32 rounding where a compiler fuses the scale and the min)."""
    for qtype in sorted(COMPILED_TYPES):
        out_features, k = odd_shape(qtype)
        weight = random_weight(qtype, out_features, k, seed=4)
        x = torch.randn(3, k)
        torch_slabs = slab_linear(x, weight, None, compiled=False)
        compiled_slabs = slab_linear(x, weight, None, compiled=True)
        assert relative_error(compiled_slabs, torch_slabs) <= DEQUANTIZE_RTOL[torch.float32]


def test_the_load_check_catches_a_wrong_kernel(cpu_library, compiled) -> None:
    """The check the library passes at load fails a multiply that forgets the bias and
    a dequantization that reads the wrong rows (so a broken build stays off), and
    passes the real ops."""
    linear_op, dequantize_op = cpu_library.quant_linear_op, cpu_library.quant_dequantize_op
    check_quant_ops(linear_op, dequantize_op)

    def without_bias(out, x, data, qtype, k, bias):
        linear_op(out, x, data, qtype, k, None)

    def rows_reversed(out, data, qtype):
        dequantize_op(out, data.flip(0).contiguous(), qtype)

    with pytest.raises(RuntimeError, match="linear off by"):
        check_quant_ops(without_bias, dequantize_op)
    with pytest.raises(RuntimeError, match="dequantize off by"):
        check_quant_ops(linear_op, rows_reversed)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "BF16"])
def test_torch_fallback_slabs_match_f_linear(qtype: str) -> None:
    out_features, k = odd_shape(qtype)
    weight = random_weight(qtype, out_features, k, seed=5)
    x, bias = torch.randn(7, k), torch.randn(out_features)
    expected = F.linear(x, dequantize(weight), bias)
    for slab_values in (k, 4 * k, None):  # one row a slab, several, and all in one
        out = slab_linear(x, weight, bias, compiled=False, slab_values=slab_values)
        assert relative_error(out, expected) <= 1e-6


def test_without_a_compiler_quantized_linear_serves_through_torch(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import torch, torch.nn.functional as F
        from kvscope.kernels.cpu_decode import cpu_kernel
        from kvscope.kernels.ggml_quants import random_blocks
        from kvscope.kernels.quantized import QuantizedWeight, dequantize, quantized_linear
        g = torch.Generator().manual_seed(0)
        w = QuantizedWeight("Q4_K", (70, 512), random_blocks("Q4_K", 70, 512, g))
        for rows in (1, 64):
            x = torch.randn(rows, 512, generator=g).bfloat16()
            y = quantized_linear(x, w)
            ref = F.linear(x, dequantize(w, torch.bfloat16))
            assert y.dtype == torch.bfloat16 and y.equal(ref), rows
        print("OP", cpu_kernel().quant_linear_op, "WHY", cpu_kernel().why_not)
        """
    )
    env = {"CXX": "/nonexistent/g++", "KVSCOPE_KERNEL_CACHE": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert "OP None WHY no C++ compiler" in result.stdout


def test_a_row_view_and_a_stack_multiply_as_the_whole(compiled) -> None:
    weight = random_weight("Q5_1", 37, 96, seed=6)
    parts = [weight.rows(0, 10), weight.rows(10, 11), weight.rows(11, 37)]
    assert parts[0].data.data_ptr() == weight.data.data_ptr()  # a view, not a copy
    stacked = concat_rows(parts)
    assert stacked.shape == weight.shape and stacked.data.equal(weight.data)
    for rows in (1, 2 * DOT_ROWS):
        x = torch.randn(rows, 96).bfloat16()
        whole = quantized_linear(x, weight)
        assert quantized_linear(x, stacked).equal(whole)
        pieces = torch.cat([quantized_linear(x, part) for part in parts], dim=1)
        if rows <= DOT_ROWS:  # each output's dot product is computed on its own
            assert pieces.equal(whole)
        else:  # oneDNN may block a narrower multiply otherwise
            assert torch.allclose(pieces.float(), whole.float(), rtol=1e-2, atol=1e-2)


def test_bad_weights_and_inputs_are_refused_by_name() -> None:
    weight = random_weight("Q4_0", 4, 64)
    with pytest.raises(ValueError, match="Q2_K"):
        QuantizedWeight("Q2_K", (4, 256), torch.zeros(4, 84, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple"):
        QuantizedWeight("Q4_K", (4, 96), torch.zeros(4, 54, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\(4, 36\)"):
        QuantizedWeight("Q4_0", (4, 64), torch.zeros(4, 35, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out of range"):
        weight.rows(2, 5)
    with pytest.raises(ValueError, match="Q8_0"):
        concat_rows([weight, random_weight("Q8_0", 4, 64)])
    with pytest.raises(ValueError, match="65 features"):
        quantized_linear(torch.randn(2, 65), weight)
    with pytest.raises(ValueError, match="bias"):
        quantized_linear(torch.randn(2, 64), weight, torch.randn(5))


def test_leading_dimensions_are_kept() -> None:
    weight = random_weight("Q8_0", 5, 64)
    x = torch.randn(2, 3, 64)
    y = quantized_linear(x, weight)
    assert y.shape == (2, 3, 5)
    assert quantized_linear(torch.randn(0, 64), weight).shape == (0, 5)
    assert torch.allclose(y[1, 2], quantized_linear(x[1, 2:3], weight)[0], rtol=1e-5, atol=1e-5)


REAL_TENSORS = ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight")


def test_real_smollm2_tensors(smollm2_gguf: Path, cpu_library) -> None:
    """A few tensors of the real Q4_1 file (its embedding is Q8_0): dequantized as gguf
    does, and multiplied within the bound by the kernel and the fallback."""
    reader = gguf.GGUFReader(smollm2_gguf)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    for name in REAL_TENSORS:
        tensor = tensors[name]
        rows = min(int(tensor.data.shape[0]), 4096)
        data = torch.from_numpy(np.array(tensor.data[:rows]))
        weight = QuantizedWeight(tensor.tensor_type.name, (rows, int(tensor.shape[0])), data)
        reference = dequantize(weight)
        assert np.array_equal(reference.numpy(), gguf_dequantize(weight)), name
        x = torch.randn(3, weight.in_features).bfloat16()
        expected = F.linear(x.float(), reference)
        assert relative_error(quantized_linear(x, weight), expected) <= LINEAR_RTOL, name
        assert relative_error(slab_linear(x, weight, None, compiled=False), expected) <= 1e-2
