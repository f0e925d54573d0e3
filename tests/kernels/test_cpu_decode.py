"""The compiled CPU decode kernel against the torch reference, and its build: in the
background while the engine serves on the fallback, and not at all without a compiler.

The kernel is built (or loaded from the cache) once per test session; where no C++
compiler exists the kernel tests are skipped with that reason, and the fallback test
still runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvscope.kernels import attention, attention_metadata
from kvscope.kernels.attention import reference_decode
from kvscope.kernels.cpu_decode import (
    BUILDING_PREFIX,
    SOURCES,
    build_command,
    compiler,
    cpu_kernel,
    prune_builds,
)
from tests.kernels.conftest import attend_in_pieces

# (heads, kv_heads, head_dim, block_size): GQA 2, 3, 4 and 6 to 1, MHA, head sizes
# that are not a multiple of 8, a block size that is not a power of two; GQA 3 and 6
# also with head sizes the vector path takes (its value sums go 4 heads at a time).
SHAPES = [
    (8, 4, 64, 16),
    (8, 2, 32, 8),
    (4, 4, 16, 4),
    (6, 1, 24, 5),
    (12, 4, 20, 16),
    (12, 4, 64, 16),
    (6, 1, 32, 16),
]
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def op(cpu_library):
    return cpu_library.op


def random_cache(num_blocks, block_size, kv_heads, dim, dtype, generator, head_major):
    """A random K or V cache, in the head-major storage `KVCache` uses or block-major."""
    if head_major:
        storage = torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator)
        return storage.to(dtype).permute(1, 2, 0, 3)
    return torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator).to(dtype)


def ragged_case(heads, kv_heads, dim, block_size, dtype, *, head_major=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 7 * block_size + 2]
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 3

    keys, values = (
        random_cache(num_blocks, block_size, kv_heads, dim, dtype, generator, head_major)
        for _ in range(2)
    )
    # Scattered blocks; the padding past each row's blocks points at block 0.
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    for row, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            tables[row, j] = order.pop()
    query = torch.randn(len(lens), heads, dim, generator=generator).to(dtype)
    return query, keys, values, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "block-major"])
def test_kernel_matches_reference(op, shape, dtype, head_major) -> None:
    heads, kv_heads, dim, block_size = shape
    query, keys, values, tables, lens = ragged_case(*shape, dtype, head_major=head_major)
    out = torch.full_like(query, float("nan"))
    op(out, query, keys, values, tables, lens, dim**-0.5)
    ref = reference_decode(query.float(), keys.float(), values.float(), tables, lens, dim**-0.5)
    error = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert error <= RTOL[dtype], f"max error {error:.1e} relative"


def test_kernel_reads_a_strided_query_and_threads(op) -> None:
    """A query sliced out of a wider tensor (as the step's decode rows are), on 1 and 2
    threads, gives the same result."""
    query, keys, values, tables, lens = ragged_case(8, 2, 32, 8, torch.float32)
    wide = torch.cat([query, torch.zeros_like(query)], dim=1)[:, :8]
    assert not wide.is_contiguous()
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.empty_like(query)
            op(out, wide, keys, values, tables, lens, 0.125)
            results.append(out)
    finally:
        torch.set_num_threads(threads)
    ref = reference_decode(query, keys, values, tables, lens, 0.125)
    assert torch.allclose(results[0], ref, atol=1e-5) and torch.equal(results[0], results[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_long_sequences_are_cut_into_spans_and_merged(op, dtype, threads) -> None:
    """Too few (sequence, KV head) pairs for the threads: their blocks are cut into
    shares whose partial softmaxes are merged. Ragged, so the long row is cut and the
    short one is not; GQA 4 to 1 and MHA."""
    generator = torch.Generator().manual_seed(1)
    block_size, dim = 16, 64
    lens = torch.tensor([1100, 30], dtype=torch.int32)
    width = -(-1100 // block_size)
    blocks = 2 * width + 1
    tables = torch.randperm(blocks, generator=generator)[: 2 * width].view(2, width)
    for heads, kv_heads in ((4, 1), (2, 2)):
        keys = torch.randn(blocks, block_size, kv_heads, dim, generator=generator).to(dtype)
        values = torch.randn(blocks, block_size, kv_heads, dim, generator=generator).to(dtype)
        # Large scores, so that a span's max differs from the sequence's and the merge's
        # rescaling matters.
        query = (3 * torch.randn(2, heads, dim, generator=generator)).to(dtype)
        previous = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            out = torch.full_like(query, float("nan"))
            op(out, query, keys, values, tables.contiguous(), lens, dim**-0.5)
        finally:
            torch.set_num_threads(previous)
        ref = reference_decode(query.float(), keys.float(), values.float(), tables, lens, dim**-0.5)
        error = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert error <= RTOL[dtype], f"max error {error:.1e} relative ({heads}/{kv_heads} heads)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("length", "threads"), [(300, 2), (300, 3), (200, 2), (120, 2), (40, 2)])
def test_one_row_is_shared_among_the_threads_block_by_block(op, dtype, length, threads) -> None:
    """One decode row of SmolLM2's heads (9 query, 3 KV, size 64): its three KV heads'
    blocks in a row are cut into one equal share a thread, so that a KV head is cut
    between two shares (300 and 200 at 2 threads), or not (300 at 3: a head a share;
    120: one share each head), or the row is too short to share (40)."""
    generator = torch.Generator().manual_seed(2)
    block_size, dim, heads, kv_heads = 16, 64, 9, 3
    width = -(-length // block_size)
    tables = torch.randperm(width + 3, generator=generator)[:width].view(1, width).contiguous()
    keys = torch.randn(width + 3, block_size, kv_heads, dim, generator=generator).to(dtype)
    values = torch.randn(width + 3, block_size, kv_heads, dim, generator=generator).to(dtype)
    query = (3 * torch.randn(1, heads, dim, generator=generator)).to(dtype)
    lens = torch.tensor([length], dtype=torch.int32)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = torch.full_like(query, float("nan"))
        op(out, query, keys, values, tables, lens, dim**-0.5)
    finally:
        torch.set_num_threads(previous)
    ref = reference_decode(query.float(), keys.float(), values.float(), tables, lens, dim**-0.5)
    error = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert error <= RTOL[dtype], f"max error {error:.1e} relative"


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "in pieces"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_chunks_attend_in_place_as_through_sdpa(op, dtype, sliced, monkeypatch) -> None:
    """A step of two decode rows, a prompt's first chunk, a later chunk of another
    prompt (both short enough for the kernel, row by row) and a chunk past
    IN_PLACE_PREFILL_CONTEXT (gather + SDPA either way): every row attends as it does
    on the torch path; so it does with the in-place chunks cut into pieces of rows
    (some inside a chunk), with a checkpoint before each piece."""
    monkeypatch.setattr(attention_metadata, "IN_PLACE_PREFILL_CONTEXT", 40)
    generator = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, block_size = 8, 4, 32, 4
    starts, lengths = [5, 30, 0, 9, 37], [1, 1, 13, 20, 6]
    num_blocks = sum(-(-(s + n) // block_size) for s, n in zip(starts, lengths, strict=True))
    order = torch.randperm(num_blocks + 2, generator=generator).tolist()
    tables = [
        [order.pop() for _ in range(-(-(s + n) // block_size))]
        for s, n in zip(starts, lengths, strict=True)
    ]
    meta = attention.build_metadata(
        starts=starts,
        lengths=lengths,
        block_tables=tables,
        block_size=block_size,
        device=torch.device("cpu"),
    )
    assert [span.in_place for span in meta.prefills] == [True, True, False]
    assert [(run.start, run.end) for run in meta.prefill_runs] == [(2, 35)]
    # Through the kernel whichever was quicker on this machine when it loaded.
    monkeypatch.setattr(cpu_kernel(), "prefill_in_place", True)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    keys = rand(kv_heads, num_blocks + 2, block_size, dim).permute(1, 2, 0, 3)
    values = rand(kv_heads, num_blocks + 2, block_size, dim).permute(1, 2, 0, 3)
    tokens = sum(lengths)
    query, key, value = (
        rand(tokens, heads, dim),
        rand(tokens, kv_heads, dim),
        rand(tokens, kv_heads, dim),
    )

    def attend(path: str) -> torch.Tensor:
        monkeypatch.setenv("KVSCOPE_ATTENTION", path)
        attention.decode_backend.cache_clear()
        try:
            backend = attention.decode_backend("cpu")
            in_place = getattr(backend, "prefills_in_place", lambda _: False)(dtype)
            assert in_place == (path == "auto")
            if not sliced or path != "auto":
                return attention.paged_attention(query, key, value, keys, values, meta, dim**-0.5)
            out, checkpoints = attend_in_pieces(query, key, value, keys, values, meta, dim**-0.5)
            # after the decode rows, and between pieces of the 33 rows of two chunks
            # (13 and 20 rows): more pieces than chunks, so some cut inside a chunk;
            # the chunk past IN_PLACE_PREFILL_CONTEXT in pieces of its 6 rows too
            assert 2 + 6 < checkpoints <= 33 + 6
            return out
        finally:
            attention.decode_backend.cache_clear()

    kernel, reference = attend("auto"), attend("reference")
    error = (
        (kernel.float() - reference.float()).abs().max() / reference.float().abs().max()
    ).item()
    assert error <= RTOL[dtype], f"max error {error:.1e} relative"


def prefill_case(heads, kv_heads, dim, block_size, dtype, *, head_major=True, seed=0):
    """Chunks of a step (a first chunk, later ones starting inside and at a block's
    edge, one row, one longer than a tile of rows), as `paged_prefill` takes them, and
    each row on its own as `reference_decode` takes it."""
    generator = torch.Generator().manual_seed(seed)
    starts = [0, 3, 2 * block_size, 5, 1]
    lengths = [2 * block_size + 3, 9, block_size, 1, 70]
    width = max(-(-(s + n) // block_size) for s, n in zip(starts, lengths, strict=True))
    num_blocks = len(starts) * width + 2

    keys, values = (
        random_cache(num_blocks, block_size, kv_heads, dim, dtype, generator, head_major)
        for _ in range(2)
    )
    tables = torch.randperm(num_blocks, generator=generator)[: len(starts) * width]
    tables = tables.view(len(starts), width).contiguous()
    # Scores well apart, so that a block's maximum differs from the row's.
    query = (3 * torch.randn(sum(lengths), heads, dim, generator=generator)).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    row_tables = tables.repeat_interleave(torch.tensor(lengths), dim=0)
    row_lens = torch.cat(
        [torch.arange(s + 1, s + n + 1) for s, n in zip(starts, lengths, strict=True)]
    ).to(torch.int32)
    chunks = (tables, torch.tensor(starts, dtype=torch.int32), offsets)
    return query, keys, values, chunks, (row_tables, row_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "block-major"])
def test_prefill_kernel_matches_each_row_on_its_own(op, shape, dtype, head_major) -> None:
    kernel = cpu_kernel()
    heads, kv_heads, dim, block_size = shape
    query, keys, values, chunks, rows = prefill_case(*shape, dtype, head_major=head_major)
    ref = reference_decode(query.float(), keys.float(), values.float(), *rows, dim**-0.5)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.full_like(query, float("nan"))
            kernel.prefill_op(out, query, keys, values, *chunks, dim**-0.5)
            error = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            assert error <= RTOL[dtype], f"max error {error:.1e} relative on {n} thread(s)"
    finally:
        torch.set_num_threads(threads)


def test_prefill_kernel_refuses_chunks_past_their_tables(op) -> None:
    query, keys, values, (tables, starts, offsets), _ = prefill_case(8, 4, 64, 16, torch.float32)
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="past its block table"):
        cpu_kernel().prefill_op(
            out, query, keys, values, tables[:, :1].contiguous(), starts, offsets, 0.1
        )
    with pytest.raises(RuntimeError, match="span the query"):
        cpu_kernel().prefill_op(out, query, keys, values, tables, starts, offsets - 1, 0.1)


@pytest.mark.parametrize("choice", ["kernel", "sdpa"])
def test_kvscope_prefill_says_which_attends_prefill_chunks(op, choice, monkeypatch) -> None:
    from kvscope.kernels.cpu_decode import CpuKernel

    monkeypatch.setenv("KVSCOPE_PREFILL", choice)
    kernel = CpuKernel()  # loads the build the session already made
    assert kernel.wait(timeout=60), kernel.why_not
    assert kernel.prefill_in_place == (choice == "kernel")


def _expected_isa() -> str:
    flags = set(Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0].split())
    if {"avx512f", "avx512_bf16"} <= flags:
        return "avx512-bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "scalar"


def test_the_build_takes_the_vector_path_this_cpu_has(op) -> None:
    assert cpu_kernel().isa == _expected_isa()


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler here")
def test_every_vector_path_compiles(tmp_path: Path) -> None:
    """The source compiles for each instruction set's path, including those this CPU
    cannot run (which the parity tests above cannot reach here): scalar, AVX2,
    AVX-512 and AVX-512 BF16."""
    command = build_command(compiler(), SOURCES, tmp_path / "unused.so")

    def compile_for(march: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        flags = [f"-march={march}" if a == "-march=native" else a for a in command]
        return march, subprocess.run(
            [*flags, "-fsyntax-only", "-Werror"], capture_output=True, text=True
        )

    marches = ["x86-64", "x86-64-v3", "skylake-avx512", "sapphirerapids"]
    with ThreadPoolExecutor(2) as pool:
        for march, result in pool.map(compile_for, marches):
            assert result.returncode == 0, f"-march={march}: {result.stderr[-2000:]}"


def test_kernel_rejects_what_it_cannot_read(op) -> None:
    query, keys, values, tables, lens = ragged_case(8, 4, 16, 4, torch.float32)
    with pytest.raises(RuntimeError, match="dtype"):
        op(torch.empty_like(query), query, keys.half(), values, tables, lens, 0.25)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        half = query.half()
        op(torch.empty_like(half), half, keys.half(), values.half(), tables, lens, 0.25)


def _run_engine_script(env: dict[str, str], body: str) -> subprocess.CompletedProcess[str]:
    script = (
        textwrap.dedent(
            """
        import logging, anyio
        from kvscope import Engine
        from kvscope.kernels.cpu_decode import cpu_kernel
        logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")

        async def tokens(engine):
            out = await engine.generate("Hello there", temperature=0, max_tokens=8,
                                        ignore_eos=True)
            return list(out.token_ids)

        async def main():
            async with Engine.open("tiny-random", device="cpu", model_threads=1) as engine:
        """
        )
        + textwrap.indent(textwrap.dedent(body), " " * 16)
        + "\nanyio.run(main)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )


def test_without_a_compiler_the_engine_serves_on_the_fallback(tmp_path: Path) -> None:
    result = _run_engine_script(
        {"CXX": "/nonexistent/g++", "KVSCOPE_KERNEL_CACHE": str(tmp_path)},
        """
        assert len(await tokens(engine)) == 8
        assert not cpu_kernel().ready
        print("WHY", cpu_kernel().why_not)
        """,
    )
    assert result.returncode == 0, result.stderr
    assert "WHY no C++ compiler (/nonexistent/g++ not found)" in result.stdout
    lines = [line for line in result.stderr.splitlines() if "torch fallback" in line]
    assert len(lines) == 1, result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler here")
def test_the_build_runs_in_the_background_then_takes_over(tmp_path: Path) -> None:
    """From an empty cache the engine answers on the fallback at once, builds the
    kernel meanwhile, switches to it, and the tokens do not change; a second process
    loads the cached build at start."""
    first = _run_engine_script(
        {"KVSCOPE_KERNEL_CACHE": str(tmp_path)},
        """
        before = await tokens(engine)
        assert not cpu_kernel().ready, "the build should still be running"
        ok = await anyio.to_thread.run_sync(cpu_kernel().wait, 900)
        assert ok, cpu_kernel().why_not
        assert await tokens(engine) == before
        """,
    )
    assert first.returncode == 0, first.stderr
    assert "building the CPU paged-attention kernel in the background" in first.stderr
    assert f"kernel ({_expected_isa()}) built in" in first.stderr
    assert len(list(tmp_path.glob("paged_decode-*.so"))) == 1
    second = _run_engine_script(
        {"KVSCOPE_KERNEL_CACHE": str(tmp_path)}, "assert cpu_kernel().ready\n"
    )
    assert second.returncode == 0, second.stderr
    assert "loaded from" in second.stderr and "building" not in second.stderr


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler here")
def test_a_process_that_exits_mid_build_leaves_no_compiler_running(tmp_path: Path) -> None:
    """`kvscope serve` stopped in its first minute must not leave g++ behind: the build
    it started is stopped with it (its whole process group)."""
    result = _run_engine_script(
        {"KVSCOPE_KERNEL_CACHE": str(tmp_path)},
        """
        await tokens(engine)
        assert not cpu_kernel().ready, "the build should still be running"
        """,
    )
    assert result.returncode == 0, result.stderr
    assert "building the CPU paged-attention kernel in the background" in result.stderr
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(tmp_path).encode() in cmdline.read_bytes():
                left.append(cmdline.parent.name)
        except OSError:
            pass  # it ended since the listing
    assert not left, f"processes still building into {tmp_path}: {left}"
    assert not list(tmp_path.glob("paged_decode-*.so"))


def test_old_builds_are_pruned_and_the_current_one_kept(tmp_path: Path) -> None:
    current = tmp_path / "paged_decode-current.so"
    current.write_bytes(b"in use")
    olds = []
    for age in range(5):  # paged_decode-old0.so is the most recent of them
        old = tmp_path / f"paged_decode-old{age}.so"
        old.write_bytes(b"old")
        os.utime(old, (1_000_000 - age * 1000, 1_000_000 - age * 1000))
        olds.append(old)
    os.utime(current, (1, 1))  # the one in use stays however old its file is
    unrelated = tmp_path / "notes.txt"
    unrelated.write_text("kept")
    # A build's private file: one abandoned two hours ago, one being written now.
    abandoned = tmp_path / f"{BUILDING_PREFIX}abc.so"
    abandoned.write_bytes(b"half")
    two_hours_ago = time.time() - 7200
    os.utime(abandoned, (two_hours_ago, two_hours_ago))
    building = tmp_path / f"{BUILDING_PREFIX}def.so"
    building.write_bytes(b"half")
    deleted = prune_builds(current, keep=2)
    assert sorted(deleted) == sorted([*olds[2:], abandoned])
    assert current.exists() and unrelated.exists() and building.exists()
    assert [p.exists() for p in olds] == [True, True, False, False, False]
