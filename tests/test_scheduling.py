"""The event loop's thread asks for short scheduler slices and, where the OS allows it,
a real-time priority; the model's threads run as a batch job with the default slice,
on cores of their own where they are fewer than the cores (`kvscope.scheduling`). The
slices' tests are skipped where the kernel has no per-thread slices, the real-time ones
where this process may not take the policy."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from kvscope.config import EngineConfig
from kvscope.scheduling import (
    LOOP_PRIORITY,
    LOOP_SLICE,
    OPENMP_BINDINGS,
    RealtimeLoop,
    as_model_thread,
    ask_for_realtime,
    ask_for_short_slices,
    current_slice,
    model_cores,
)
from kvscope.web.settings import ServerSettings
from tests.conftest import skip_without_realtime, thread_policy, without_realtime

needs_slices = pytest.mark.skipif(
    current_slice() is None, reason="this kernel has no per-thread slices (Linux 6.12+)"
)


def _in_thread(work: Callable[[], Any]) -> Any:
    """`work()` in a new thread of its own; its result (or its exception)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = work()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _policy_and_slice() -> tuple[int, float | None]:
    return os.sched_getscheduler(0), current_slice()


@needs_slices
def test_the_loop_asks_for_short_slices_and_a_model_thread_runs_as_a_batch_job() -> None:
    default = _in_thread(current_slice)
    assert default is not None and default > LOOP_SLICE

    def loop_thread() -> tuple[Any, ...]:
        assert ask_for_short_slices() is None
        mine = _policy_and_slice()
        inherited = _in_thread(current_slice)  # a thread the loop starts inherits it

        def model_thread() -> tuple[Any, ...]:
            as_model_thread()
            as_model_thread()  # once per thread is enough; twice changes nothing
            # torch's threads, started by the model thread, inherit both
            return _policy_and_slice(), _in_thread(_policy_and_slice)

        return mine, inherited, _in_thread(model_thread)

    mine, inherited, (model, models_child) = _in_thread(loop_thread)
    assert mine == (os.SCHED_OTHER, LOOP_SLICE) and inherited == LOOP_SLICE
    assert model == models_child == (os.SCHED_BATCH, default)


@needs_slices
def test_every_thread_of_a_worker_process_runs_as_a_batch_job() -> None:
    """In a process of its own, as in the model worker: the call changes every thread
    of the process it runs in."""
    default = _in_thread(current_slice)
    script = """
import os, threading
from kvscope.scheduling import ask_for_short_slices, current_slice, every_thread_as_model_thread
ask_for_short_slices()
ready, done, seen = threading.Event(), threading.Event(), {}
def sibling():  # started before the call, like torch's first threads
    ready.set()
    done.wait(10)
    seen["sibling"] = (os.sched_getscheduler(0), current_slice())
thread = threading.Thread(target=sibling)
thread.start()
ready.wait(10)
every_thread_as_model_thread()
seen["self"] = (os.sched_getscheduler(0), current_slice())
done.set()
thread.join()
print(repr(seen))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    batch = (os.SCHED_BATCH, default)
    assert ast.literal_eval(out) == {"self": batch, "sibling": batch}


@needs_slices
def test_the_setting_takes_a_slice_the_kernel_allows_or_none() -> None:
    assert ServerSettings().loop_slice == LOOP_SLICE
    assert ServerSettings(loop_slice=None).loop_slice is None
    for bad in (0.0, 0.00001, 1.0):
        with pytest.raises(ValueError, match="loop_slice"):
            ServerSettings(loop_slice=bad)


def test_the_loop_runs_real_time_where_allowed_and_what_it_starts_does_not() -> None:
    skip_without_realtime()
    probe = "import os; print(os.sched_getscheduler(0))"

    def loop_thread() -> tuple[Any, ...]:
        assert ask_for_realtime() is None
        mine = os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK, os.sched_getparam(0)
        thread = _in_thread(lambda: os.sched_getscheduler(0))
        child = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True
        ).stdout
        return mine, thread, int(child)

    (policy, param), thread, child = _in_thread(loop_thread)
    assert policy == os.SCHED_FIFO and param.sched_priority == LOOP_PRIORITY
    assert thread == child == os.SCHED_OTHER


def test_without_the_privilege_the_loop_is_told_why_and_nothing_changes() -> None:
    script = (
        "import os\n"
        "from kvscope.scheduling import ask_for_realtime\n"
        "print(repr((ask_for_realtime(), os.sched_getscheduler(0))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        preexec_fn=without_realtime,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    why_not, policy = ast.literal_eval(out)
    # (the child keeps the policy of the thread that started it)
    assert "sched_setscheduler failed" in why_not and policy == os.sched_getscheduler(0)


def test_the_setting_takes_a_real_time_priority_or_none() -> None:
    assert ServerSettings().loop_priority == LOOP_PRIORITY == 1
    assert ServerSettings(loop_priority=0).loop_priority == 0
    for bad in (-1, 100):
        with pytest.raises(ValueError, match="loop_priority"):
            ServerSettings(loop_priority=bad)


def test_a_busy_loop_leaves_the_real_time_policy_and_takes_it_back_once_calm() -> None:
    skip_without_realtime()

    def loop_thread() -> list[Any]:
        realtime = RealtimeLoop(LOOP_PRIORITY, LOOP_SLICE)
        assert realtime.start() is None
        seen: list[Any] = [thread_policy()]
        for busy in (0.2, 0.8, 0.4, 0.1):  # calm, busy, between, calm again
            change = realtime.observe(busy)
            seen.append((change is not None, realtime.realtime, thread_policy()))
        seen.append(current_slice())
        return seen

    fifo, other = os.SCHED_FIFO, os.SCHED_OTHER
    assert _in_thread(loop_thread) == [
        fifo,
        (False, True, fifo),
        (True, False, other),  # and the short slices again
        (False, False, other),
        (True, True, fifo),
        None,  # (a real-time thread has no slice)
    ]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_hold_measures_the_loops_share_of_its_core(backend: str) -> None:
    """A loop that never waits leaves the policy; once it idles, it takes it back."""
    skip_without_realtime()

    async def main() -> tuple[int, int]:
        realtime = RealtimeLoop(LOOP_PRIORITY, LOOP_SLICE)
        assert realtime.start() is None
        deadline = time.monotonic() + 30
        async with anyio.create_task_group() as tg:
            tg.start_soon(realtime.hold, 0.1)
            while realtime.realtime:  # busy: passes of 10 ms of work, no wait between
                end = time.perf_counter() + 0.01
                while time.perf_counter() < end:
                    pass
                await anyio.lowlevel.checkpoint()
                assert time.monotonic() < deadline, "still real-time"
            left = thread_policy()
            while not realtime.realtime:
                await anyio.sleep(0.05)
                assert time.monotonic() < deadline, "not real-time again"
            back = thread_policy()
            tg.cancel_scope.cancel()
        return left, back

    assert _in_thread(lambda: anyio.run(main, backend=backend)) == (os.SCHED_OTHER, os.SCHED_FIFO)


def test_a_model_with_fewer_threads_than_cores_keeps_to_the_last_of_them() -> None:
    assert model_cores("auto", 1, {0, 1}, {}) == {1}
    assert model_cores("auto", 2, {0, 1, 2, 3}, {}) == {2, 3}
    assert model_cores("auto", 1, {5, 3}, {}) == {5}  # the cores it may use, not 0..n


def test_a_model_that_fills_the_cores_or_is_bound_by_the_user_keeps_every_core() -> None:
    assert model_cores("auto", 2, {0, 1}, {}) is None
    assert model_cores("auto", 4, {0, 1}, {}) is None
    assert model_cores("auto", None, {0, 1}, {}) is None  # torch's default: a thread a core
    for name in OPENMP_BINDINGS:
        assert model_cores("auto", 1, {0, 1}, {name: "anything"}) is None
    assert model_cores("all", 1, {0, 1}, {}) is None


def test_listed_cores_are_kept_to_if_this_process_may_use_them() -> None:
    assert model_cores("0", 1, {0, 1}, {}) == {0}
    assert model_cores("1,3", 2, {0, 1, 2, 3}, {"OMP_PROC_BIND": "close"}) == {1, 3}
    with pytest.raises(ValueError, match="worker_cores 0,7: this process may use only cores 0,1"):
        model_cores("0,7", 1, {0, 1}, {})


def test_the_setting_takes_auto_all_or_cores_this_process_may_use() -> None:
    assert EngineConfig().worker_cores == "auto"
    mine = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    for good in ("auto", "all", mine):
        assert EngineConfig(worker_cores=good).worker_cores == good
    for bad in ("", "some", "1-3", "0,", str(max(os.sched_getaffinity(0)) + 1)):
        with pytest.raises(ValueError, match="worker_cores"):
            EngineConfig(worker_cores=bad)


def test_where_the_os_cannot_keep_threads_to_cores_auto_keeps_every_core(monkeypatch) -> None:
    """An OS without `sched_setaffinity` (macOS, Windows: not runnable here, so it is
    faked by removing the call) keeps every core under `auto`; a list is refused."""
    monkeypatch.delattr(os, "sched_setaffinity")
    assert model_cores("auto", 1, {0, 1}, {}) is None
    with pytest.raises(ValueError, match="worker_cores 0: this OS cannot keep a process to cores"):
        model_cores("0", 1, {0, 1}, {})
