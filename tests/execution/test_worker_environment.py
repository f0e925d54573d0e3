"""The environment a model worker process is spawned with
(`execution/worker_environment.py`): glibc's malloc tunables and OpenMP's spin count are added, a setting of the user's is kept as
the user set it, and the engine's own environment is left as it was."""

from __future__ import annotations

import os

import pytest

from kvscope.execution.worker_environment import GOMP_SPINCOUNT, MALLOC_TUNABLES, worker_environment

OURS = [f"{name}={value}" for name, value in MALLOC_TUNABLES.items()]


def _inside() -> list[str]:
    with worker_environment():
        return os.environ["GLIBC_TUNABLES"].split(":")


def _spin_inside() -> str | None:
    with worker_environment():
        return os.environ.get("GOMP_SPINCOUNT")


def test_openmp_spins_longer_in_the_worker_only(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert _spin_inside() == str(GOMP_SPINCOUNT)
    assert "GOMP_SPINCOUNT" not in os.environ


@pytest.mark.parametrize("name", ["GOMP_SPINCOUNT", "OMP_WAIT_POLICY"])
def test_the_users_own_openmp_wait_wins(monkeypatch, name):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv(name, "1000" if name == "GOMP_SPINCOUNT" else "PASSIVE")
    expected = "1000" if name == "GOMP_SPINCOUNT" else None
    assert _spin_inside() == expected
    assert os.environ[name] == ("1000" if name == "GOMP_SPINCOUNT" else "PASSIVE")


def test_the_tunables_are_added_for_the_spawn_only(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert _inside() == OURS
    assert "GLIBC_TUNABLES" not in os.environ


def test_other_tunables_are_kept(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert _inside() == ["glibc.malloc.arena_max=2", *OURS]
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


@pytest.mark.parametrize("name", list(MALLOC_TUNABLES))
def test_the_users_own_setting_of_a_tunable_wins(monkeypatch, name):
    monkeypatch.setenv("GLIBC_TUNABLES", f"{name}=0")
    inside = _inside()
    assert inside[0] == f"{name}=0"
    assert [entry for entry in inside if entry.startswith(f"{name}=")] == [f"{name}=0"]
    assert sorted(inside[1:]) == sorted(entry for entry in OURS if not entry.startswith(f"{name}="))


def _faults_of_churn() -> int:
    """Page faults of five rounds of eight 8 MiB blocks allocated, written and freed, as
    a step's activations are, after two rounds that warm the heap up (glibc's own
    malloc, so that nothing else allocates in between)."""
    import ctypes
    import resource

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    size = 8 << 20

    def churn(rounds: int) -> None:
        for _ in range(rounds):
            blocks = [libc.malloc(size) for _ in range(8)]
            for block in blocks:
                libc.memset(block, 1, size)
            for block in reversed(blocks):
                libc.free(block)

    churn(2)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    churn(5)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_spawned_worker_keeps_its_activations_memory(monkeypatch):
    """In a process spawned as the worker is, freed activations stay in the heap: the
    next rounds fault no page in again. With glibc's defaults every round faults its
    64 MiB in again (81,760 faults; 160 with huge pages but no thresholds)."""
    import multiprocessing

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    with worker_environment(), multiprocessing.get_context("spawn").Pool(1) as pool:
        faults = pool.apply(_faults_of_churn)
    assert faults < 16
