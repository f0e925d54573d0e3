"""The event loop's thread asks for short scheduler slices; the model's threads keep
the default (`kvscope.scheduling`). Skipped where the kernel has no per-thread slices."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvscope.scheduling import (
    LOOP_SLICE,
    ask_for_short_slices,
    current_slice,
    default_slice_every_thread,
    keep_default_slice,
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


def test_the_loop_asks_for_short_slices_and_a_model_thread_takes_the_default_back() -> None:
    default = _in_thread(current_slice)
    assert default is not None and default > LOOP_SLICE

    def loop_thread() -> tuple[float | None, float | None, float | None]:
        assert ask_for_short_slices() is None
        mine = current_slice()
        inherited = _in_thread(current_slice)  # a thread the loop starts inherits it

        def model_thread() -> float | None:
            keep_default_slice()
            keep_default_slice()  # once per thread is enough; twice changes nothing
            return current_slice()

        return mine, inherited, _in_thread(model_thread)

    mine, inherited, model = _in_thread(loop_thread)
    assert mine == LOOP_SLICE and inherited == LOOP_SLICE
    assert model == default


def test_every_thread_of_a_worker_process_gets_the_default() -> None:
    default = _in_thread(current_slice)
    ready, done = threading.Event(), threading.Event()
    seen: dict[str, float | None] = {}

    def loop_thread() -> None:
        ask_for_short_slices()

        def sibling() -> None:  # started before the reset, like torch's first threads
            ready.set()
            done.wait(10)
            seen["sibling"] = current_slice()

        thread = threading.Thread(target=sibling)
        thread.start()
        ready.wait(10)
        default_slice_every_thread()
        seen["self"] = current_slice()
        done.set()
        thread.join()

    _in_thread(loop_thread)
    assert seen == {"self": default, "sibling": default}


def test_the_setting_takes_a_slice_the_kernel_allows_or_none() -> None:
    assert ServerSettings().loop_slice == LOOP_SLICE
    assert ServerSettings(loop_slice=None).loop_slice is None
    for bad in (0.0, 0.00001, 1.0):
        with pytest.raises(ValueError, match="loop_slice"):
            ServerSettings(loop_slice=bad)
