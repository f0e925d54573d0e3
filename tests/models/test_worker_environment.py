"""The environment a model worker process is spawned with (`models/worker.py`): glibc's
malloc is asked for transparent huge pages, a tunable the user set is kept, and the
engine's own environment is left as it was."""

from __future__ import annotations

import os

import pytest

from kvscope.models.worker import MALLOC_TUNABLES, worker_environment


def _inside() -> str | None:
    with worker_environment():
        return os.environ.get("GLIBC_TUNABLES")


def test_the_tunable_is_added_for_the_spawn_only(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert _inside() == MALLOC_TUNABLES
    assert "GLIBC_TUNABLES" not in os.environ


def test_other_tunables_are_kept(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert _inside() == f"glibc.malloc.arena_max=2:{MALLOC_TUNABLES}"
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


@pytest.mark.parametrize("users", ["glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=2"])
def test_the_users_own_hugetlb_setting_wins(monkeypatch, users):
    monkeypatch.setenv("GLIBC_TUNABLES", users)
    assert _inside() == users
