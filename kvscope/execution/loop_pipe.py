"""The engine's end of the model worker's pipe, written and read by the event loop.

A step sent from a thread costs two thread wake-ups a step (the loop hands the step to
the thread, the thread hands the answer back through the loop's self-pipe) and the GIL
passed between the two each time: at one stream that hop was a quarter of the
server's CPU per token (py-spy, reference model). `LoopPipe` lets the step actor send
the step and wait for the answer on the loop itself, never blocking: the socket is
written and read with `MSG_DONTWAIT` and waited on with anyio.

It speaks the frames of `multiprocessing.connection.Connection` (a big-endian 4-byte
length, or -1 and an 8-byte length, then the pickle), so the worker keeps its
`Connection`, and a step may still go through the blocking `Connection` from a thread
between two steps sent here. Its socket is a duplicate of the `Connection`'s, so the
flags of the one file stay as they were (blocking).
"""

from __future__ import annotations

import os
import socket
import struct
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import anyio

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")


class LoopPipe:
    def __init__(self, conn: Connection) -> None:
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))

    def close(self) -> None:
        self._sock.close()

    async def send(self, message: Any) -> None:
        payload = bytes(ForkingPickler.dumps(message))
        size = len(payload)
        if size > 0x7FFFFFFF:
            header = _SHORT.pack(-1) + _LONG.pack(size)
        else:
            header = _SHORT.pack(size)
        data = memoryview(header + payload)
        while data:
            try:
                data = data[self._sock.send(data, socket.MSG_DONTWAIT) :]
            except BlockingIOError:
                await anyio.wait_writable(self._sock)

    async def receive(self) -> Any:
        """The next message; EOFError if the worker closed its end (it exited)."""
        buffer = bytearray()
        while (frame := _frame(buffer)) is None or len(buffer) < frame[0] + frame[1]:
            try:
                chunk = self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                await anyio.wait_readable(self._sock)
                continue
            if not chunk:
                raise EOFError("the model worker closed its pipe")
            buffer += chunk
        start, size = frame
        if len(buffer) != start + size:  # the worker answers each step once
            raise RuntimeError("the model worker sent more than one answer")
        return ForkingPickler.loads(memoryview(buffer)[start:])


def _frame(buffer: bytearray) -> tuple[int, int] | None:
    """(payload start, payload size) once the header has arrived."""
    if len(buffer) < _SHORT.size:
        return None
    (size,) = _SHORT.unpack_from(buffer)
    if size != -1:
        return _SHORT.size, size
    if len(buffer) < _SHORT.size + _LONG.size:
        return None
    return _SHORT.size + _LONG.size, _LONG.unpack_from(buffer, _SHORT.size)[0]
