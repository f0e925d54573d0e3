"""The K/V cache's storage follows the kernels that will read it: block-major on the
CPU wherever the compiled library can be built (a slot's heads on one page), head-major
where only the torch reference will serve (no compiler, or the reference forced)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing

from kvscope.cache.kv_cache import KVCache
from kvscope.kernels.attention import block_major_cache
from kvscope.kernels.cpu_decode import compiler

CPU = torch.device("cpu")


def cache() -> KVCache:
    return KVCache(
        num_layers=2, num_blocks=6, block_size=4, num_kv_heads=3, head_dim=8,
        dtype=torch.float32, device=CPU, block_major=block_major_cache(CPU),
    )  # fmt: skip


def slot_heads_adjacent(tensor: torch.Tensor) -> bool:
    """Whether one slot's heads lie next to each other in memory (block-major)."""
    return tensor.stride(2) == tensor.shape[3]


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler here")
def test_block_major_where_the_library_can_serve(monkeypatch) -> None:
    monkeypatch.delenv("KVSCOPE_ATTENTION", raising=False)
    assert block_major_cache(CPU)
    kv = cache()
    assert all(slot_heads_adjacent(t) and t.is_contiguous() for t in (*kv.keys, *kv.values))


@pytest.mark.parametrize(
    "env", [{"CXX": "/nonexistent/g++"}, {"KVSCOPE_ATTENTION": "reference"}], ids=str
)
def test_head_major_where_only_the_reference_serves(monkeypatch, env) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert not block_major_cache(CPU)
    kv = cache()
    for tensor in (*kv.keys, *kv.values):
        assert not slot_heads_adjacent(tensor)
        assert tensor.permute(2, 0, 1, 3).is_contiguous()  # [kv_heads, blocks, slots, dim]


def test_either_layout_reads_and_writes_the_same_slots(monkeypatch) -> None:
    """A block copy (copy-on-write) moves the same values whatever the storage."""
    seen = []
    for env in ({"KVSCOPE_ATTENTION": "reference"}, {}):
        monkeypatch.delenv("KVSCOPE_ATTENTION", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        kv = cache()
        for index, tensor in enumerate((*kv.keys, *kv.values)):
            tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32).view(tensor.shape))
            tensor.add_(index)
        kv.copy_blocks([(1, 4), (2, 5)])
        seen.append([t.clone() for t in (*kv.keys, *kv.values)])
    for head_major, other in zip(*seen, strict=True):
        assert torch.equal(head_major, other)
        assert torch.equal(head_major[4], head_major[1]) and torch.equal(
            head_major[5], head_major[2]
        )


def advised_huge(address: int) -> bool:
    """Whether the mapping holding `address` was advised for huge pages (`hg`)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()
    return False


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
    reason="no transparent huge pages in this kernel",
)
def test_the_cpu_cache_asks_for_huge_pages() -> None:
    """Each layer's K and V storage (16 MiB here) is advised for transparent huge pages
    before its first touch, so the decode's scattered blocks miss the TLB less."""
    kv = KVCache(
        num_layers=2, num_blocks=1024, block_size=16, num_kv_heads=4, head_dim=64,
        dtype=torch.float32, device=CPU, block_major=block_major_cache(CPU),
    )  # fmt: skip
    for tensor in (*kv.keys, *kv.values):
        middle = tensor.data_ptr() + tensor.untyped_storage().nbytes() // 2
        assert advised_huge(middle)
        assert not tensor.any()  # still zeros, as before


def _pattern(index: int, tensor: torch.Tensor) -> torch.Tensor:
    """What tensor `index` of the shared cache is filled with: small integers, exact in
    bfloat16, that differ from slot to slot (a copy in another layout would show)."""
    values = torch.arange(tensor.numel()).remainder(251).add(index + 1)
    return values.to(tensor.dtype).view(tensor.shape)


def _take_over(kv: KVCache, keep_contents: bool, answer) -> None:
    """(a spawned child, as the model worker) Take the shared cache over; report whether
    it holds what it should, and the page faults of a write to every page of it."""
    own = kv.taken_over(keep_contents=keep_contents)
    tensors = (*own.keys, *own.values)
    held = all(
        torch.equal(t, _pattern(i, t) if keep_contents else torch.zeros_like(t))
        and t.stride() == shared.stride()
        for i, (t, shared) in enumerate(zip(tensors, (*kv.keys, *kv.values), strict=True))
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for tensor in tensors:
        tensor.view(-1)[:: 4096 // tensor.element_size()] = 1
    answer.put((held, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))


@pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_REMOVE) is Linux's")
@pytest.mark.parametrize("keep_contents", [True, False], ids=["copied", "fresh"])
def test_a_worker_takes_the_shared_cache_over_as_its_own(keep_contents: bool) -> None:
    """At its hand-over the model worker takes the cache the engine shared with it over
    as memory of its own (huge pages where Linux gives them, which shared memory gets
    by default not): the same layout, the engine's blocks copied where it ran steps,
    every page mapped in before the first step, and the shared pages given back."""
    kv = KVCache(
        num_layers=2, num_blocks=256, block_size=16, num_kv_heads=4, head_dim=64,
        dtype=torch.bfloat16, device=CPU, block_major=block_major_cache(CPU),
    )  # fmt: skip
    kv.share_memory()
    for index, tensor in enumerate((*kv.keys, *kv.values)):
        tensor.copy_(_pattern(index, tensor))
    pages = sum(t.untyped_storage().nbytes() for t in (*kv.keys, *kv.values)) // 4096
    context = torch.multiprocessing.get_context("spawn")
    answer = context.Queue()
    child = context.Process(target=_take_over, args=(kv, keep_contents, answer))
    child.start()
    held, faults = answer.get(timeout=120)
    child.join(60)
    assert held
    assert faults < pages // 10  # mapped in by the copy (or the zeros)
    assert not any(t.any() for t in (*kv.keys, *kv.values))  # the shared pages went back
