"""The event loop's thread asks for short scheduler slices; the model's threads run as a
batch job with the default slice (`kvscope.scheduling`). Skipped where the kernel has no
per-thread slices."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvscope.scheduling import (
    LOOP_SLICE,
    as_model_thread,
    ask_for_short_slices,
    current_slice,
)
from kvscope.web.settings import ServerSettings

pytestmark = pytest.mark.skipif(
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


def test_the_setting_takes_a_slice_the_kernel_allows_or_none() -> None:
    assert ServerSettings().loop_slice == LOOP_SLICE
    assert ServerSettings(loop_slice=None).loop_slice is None
    for bad in (0.0, 0.00001, 1.0):
        with pytest.raises(ValueError, match="loop_slice"):
            ServerSettings(loop_slice=bad)
