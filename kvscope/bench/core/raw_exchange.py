"""The process behind `RawHttp`: bodiless HTTP/1.1 requests written and read by hand on
kept-alive blocking sockets, each stamped where it is made.

It is a process of its own, with a GIL of its own, because the benchmark's client reads
32 streams on its event loop meanwhile: a thread of that process, woken by the answer,
first had to wait for the GIL, which the loop holds while it parses the chunks that
arrive in the same instant as a cancel's answer (cancels go out right after a token).
Here nothing else runs: the stamps are the socket's.

Standard library only, so it starts in a few tens of milliseconds. One line in on
stdin per request, `<id> <METHOD> <path>`; one JSON line out on stdout per answer,
`{"id", "status", "body", "sent_wall", "rtt"}` or `{"id", "error", "kind"}`; each
request runs on a thread of its own, so requests in flight do not wait for each other.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time


class Stale(ConnectionError):
    """A kept-alive socket the server closed while it was idle."""


class Exchanger:
    """Kept-alive sockets to one server; `exchange` makes one request on one of them."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def request(self, head: bytes) -> tuple[int, bytes, float, float]:
        """(status, body, sent_wall, rtt): the request's time stamps, on this thread."""
        while (sock := self._take_idle()) is not None:
            try:
                return self._exchange(sock, head)
            except Stale:
                continue  # closed by the server while idle: the request never reached it
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._exchange(sock, head)

    def close(self) -> None:
        with self._lock:
            for sock in self._idle:
                sock.close()
            self._idle.clear()

    def _take_idle(self) -> socket.socket | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def _exchange(self, sock: socket.socket, head: bytes) -> tuple[int, bytes, float, float]:
        try:
            sent_wall, sent = time.time(), time.perf_counter()
            sock.sendall(head)
            status, body, keep = read_reply(sock)
            rtt = time.perf_counter() - sent
        except BaseException:
            sock.close()
            raise
        if keep:
            with self._lock:
                self._idle.append(sock)
        else:
            sock.close()
        return status, body, sent_wall, rtt


def read_reply(sock: socket.socket) -> tuple[int, bytes, bool]:
    """One response: the status, the body (by `content-length`), and whether the
    connection stays open."""

    def more() -> bytes:
        chunk = sock.recv(65536)
        if not chunk:
            raise Stale("the server closed the connection")
        return chunk

    data = b""
    while b"\r\n\r\n" not in data:
        data += more()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    length = int(headers.get("content-length", "-1"))
    if length < 0:
        raise ValueError("RawHttp reads answers with a content-length only")
    while len(body) < length:
        body += more()
    return status, body[:length], headers.get("connection") != "close"


def main() -> None:
    host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    exchanger = Exchanger(host, port, timeout)
    out = threading.Lock()

    def answer(reply: dict[str, object]) -> None:
        with out:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()

    def one(request_id: str, method: str, path: str) -> None:
        head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n\r\n"
        try:
            status, body, sent_wall, rtt = exchanger.request(head.encode())
        except TimeoutError as exc:
            answer({"id": request_id, "error": repr(exc), "kind": "timeout"})
        except Exception as exc:  # the caller raises it, whatever it was
            answer({"id": request_id, "error": repr(exc), "kind": "other"})
        else:
            body_text = body.decode("latin-1")
            answer(
                {
                    "id": request_id,
                    "status": status,
                    "body": body_text,
                    "sent_wall": sent_wall,
                    "rtt": rtt,
                }
            )

    for line in sys.stdin:
        request_id, method, path = line.split()
        threading.Thread(target=one, args=(request_id, method, path), daemon=True).start()
    exchanger.close()


if __name__ == "__main__":
    main()
