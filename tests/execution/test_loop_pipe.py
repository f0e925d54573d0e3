"""The engine's end of the model worker's pipe on the event loop (`execution/loop_pipe.py`):
it reads and writes the frames of the worker's `multiprocessing` `Connection`, messages
larger than the socket's buffer included, and says when the worker's end is closed.
Runs on asyncio and trio."""

from __future__ import annotations

import multiprocessing
import threading

import anyio
import pytest

from kvscope.execution.loop_pipe import LoopPipe

pytestmark = pytest.mark.anyio

#: Larger than a socketpair's buffer, so it crosses in several reads and writes.
LARGE = {"states": [bytes([i]) * 5056 for i in range(256)], "tokens": list(range(10_000))}


async def test_messages_cross_both_ways_whatever_their_size():
    ours, theirs = multiprocessing.Pipe()
    pipe = LoopPipe(ours)
    got: list[object] = []

    def worker() -> None:  # the worker's side: a plain blocking Connection
        while (message := theirs.recv()) is not None:
            got.append(message)
            theirs.send(("done", message))

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        for message in ("small", LARGE, ("step", [1, 2, 3]), LARGE):
            with anyio.fail_after(30):
                await pipe.send(message)
                assert await pipe.receive() == ("done", message)
    finally:
        ours.send(None)
        thread.join(30)
    assert got == ["small", LARGE, ("step", [1, 2, 3]), LARGE]
    pipe.close()
    assert not ours.closed  # the Connection keeps its own socket
    ours.close()


async def test_a_closed_worker_end_is_an_eof():
    ours, theirs = multiprocessing.Pipe()
    pipe = LoopPipe(ours)
    theirs.send(("done", [7]))
    theirs.close()
    assert await pipe.receive() == ("done", [7])
    with pytest.raises(EOFError), anyio.fail_after(30):
        await pipe.receive()
    pipe.close()
    ours.close()
