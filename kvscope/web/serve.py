"""`kvscope serve`: parse the server's arguments and run `Server` until it is stopped.

With no flags it serves the bundled model on 127.0.0.1:8000 on asyncio. Keys come
from `--api-key` (repeatable) and `KVSCOPE_API_KEY` (comma-separated). It prints where
it listens and what it runs, and exits 0 after a graceful SIGINT/SIGTERM shutdown.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import anyio

from kvscope.cli import add_engine_arguments, engine_kwargs

from .server import Server
from .settings import ServerSettings

log = logging.getLogger("kvscope.web")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    group.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a bearer key (repeatable; also KVSCOPE_API_KEY)",
    )
    group.add_argument(
        "--audit-log", default=None, metavar="PATH", help="append one JSON line per ended request"
    )
    group.add_argument(
        "--drain-timeout",
        type=float,
        default=0.0,
        help="seconds live requests may finish on shutdown",
    )
    group.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 past it)"
    )
    group.add_argument(
        "--debug", action="store_true", help="check the block pool whenever the engine idles"
    )
    replicas = parser.add_argument_group("replicas on Ray Serve (pip install 'kvscope[ray]')")
    replicas.add_argument(
        "--replicas", type=int, default=0, help="serve N engine replicas through Ray Serve"
    )
    replicas.add_argument("--ray-address", default=None, help="join this Ray cluster")
    replicas.add_argument("--ray-cpus", type=int, default=None, help="CPUs of a local Ray")
    replicas.add_argument("--cpus-per-replica", type=float, default=1.0)
    replicas.add_argument(
        "--request-timeout", type=float, default=None, help="Ray Serve's end-to-end timeout (s)"
    )
    add_engine_arguments(parser)


def settings_from(args: argparse.Namespace) -> ServerSettings:
    keys = list(args.api_key)
    keys += [k for k in os.environ.get("KVSCOPE_API_KEY", "").split(",") if k.strip()]
    return ServerSettings(
        host=args.host,
        port=args.port,
        backend=args.backend,
        api_keys=keys,
        max_body_bytes=args.max_body_bytes,
        drain_timeout=args.drain_timeout,
    )


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
        kwargs = engine_kwargs(args)
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kwargs["debug"] = args.debug
    if args.replicas:
        from kvscope.replicas.cli import run as run_replicas  # imports Ray only here

        return run_replicas(args, settings, kwargs)
    server = Server(settings, kwargs, handle_signals=True)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(server.run)
            print(
                f"kvscope serving {args.model} on {server.url} "
                f"(device {server.engine.device if server.engine else '?'}, backend {settings.backend})",
                flush=True,
            )

    try:
        try:
            anyio.run(main, backend=settings.backend)
        except BaseExceptionGroup as group:
            raise _first(group) from None
    except OSError as exc:
        print(f"error: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # ModelLoadError and bad engine settings
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _first(group: BaseExceptionGroup) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
