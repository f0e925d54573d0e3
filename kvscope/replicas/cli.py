"""`kvscope serve --replicas N`: start a local Ray (or join one), run the Serve app,
print where it listens, and on SIGINT/SIGTERM stop Serve (each replica drains like the
single server: every stream ends with its last event) and Ray, and exit 0; a second
signal skips the drain. SIGHUP redeploys: Serve replaces the replicas one by one, each
old one draining its streams while new requests go to the others.

`ray.init` installs Ray's own SIGTERM handler (exit at once, with Ray's processes
killed under the streams), so kvscope's handlers are installed again after it.

With `--ray-address` it joins a running cluster (`auto`, or `ray://host:10001`)
instead of starting Ray here; with no address Ray is started with `--ray-cpus` logical
CPUs and no dashboard. `--port 0` picks a free port before Serve's proxy binds it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

import attrs

from kvscope.web.server import bind_socket
from kvscope.web.settings import ServerSettings

APP_NAME = "kvscope"


def run(args: argparse.Namespace, settings: ServerSettings, engine_kwargs: dict[str, Any]) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        print("error: --replicas needs Ray Serve: pip install 'kvscope[ray]'", file=sys.stderr)
        return 2
    from .deployment import build_app
    from .proxy import CALLBACK_ENV, CALLBACK_PATH

    refusal = _refusal(settings)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    port = settings.port or _free_port(settings.host)
    signals = _Signals()
    # Serve's proxy reads this when it starts (in a process that inherits it from
    # the local Ray started below; on a cluster, set it on every node's Ray).
    os.environ.setdefault(CALLBACK_ENV, CALLBACK_PATH)
    try:
        _start_ray(args)
        signals.install()  # again: ray.init took SIGTERM
        serve.start(
            http_options={
                "host": settings.host,
                "port": port,
                "request_timeout_s": args.request_timeout,
            }
        )
        app = build_app(
            engine_kwargs,
            replicas=args.replicas,
            settings={**attrs.asdict(settings), "port": port},
            cpus_per_replica=args.cpus_per_replica,
            proxy_url=f"http://{_local(settings.host)}:{port}",
            request_timeout_s=args.request_timeout,
            prefix_routing=args.prefix_routing,
            direct_host=settings.host,
        )
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        banner = (
            f"kvscope serving {engine_kwargs['model']} on http://{host}:{port} "
            f"({args.replicas} replicas on Ray Serve)"
        )
        _serve_until_stopped(app, banner, signals)
    except _StopNow:
        print("kvscope: stopping now, without draining (a second signal)", flush=True)
    finally:
        ray.shutdown()
    return 0


def _refusal(settings: ServerSettings) -> str | None:
    """What of the server's settings replicas cannot do, said as an error."""
    if settings.backend != "asyncio":
        return "Ray Serve replicas run on asyncio; drop --backend trio"
    if settings.runtime_lora_updating:
        return (
            "runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING) would load an "
            "adapter in the one replica the call reaches; give adapters with --lora-modules"
        )
    return None


def _start_ray(args: argparse.Namespace) -> None:
    """Join the cluster at `--ray-address`, or start Ray here with `--ray-cpus`."""
    import ray

    if args.ray_address:
        ray.init(address=args.ray_address, include_dashboard=False)
    else:
        ray.init(num_cpus=args.ray_cpus, include_dashboard=False)


def _serve_until_stopped(app: Any, banner: str, signals: _Signals) -> None:
    """Run `app` on Serve, roll it on SIGHUP, and stop it (draining) on SIGINT/SIGTERM."""
    from ray import serve

    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    print(banner, flush=True)
    while signals.wait() == "roll":
        # Each `serve.run` from Python is a new version: Serve replaces the
        # replicas one by one, each old one draining (see `stopping`).
        print("kvscope: rolling the replicas (SIGHUP)", flush=True)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        print("kvscope: the new replicas are serving", flush=True)
    print("kvscope: stopping the replicas", flush=True)
    # Serve stops each replica gracefully: it drains (see `stopping`) while the
    # proxy still carries its streams' last events; then the proxy goes.
    serve.delete(APP_NAME)
    serve.shutdown()


class _StopNow(Exception):
    """A second SIGINT/SIGTERM: stop Ray without waiting for the drain."""


class _Signals:
    """SIGINT/SIGTERM stop (a second one raises `_StopNow`, in the main thread); SIGHUP
    rolls the replicas (`wait` says which came)."""

    def __init__(self) -> None:
        self._stop = False
        self._stopping_now = False  # `_StopNow` raised (once: not out of the cleanup)
        self._rolls = 0
        self._wake = threading.Event()
        self.install()

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_roll)

    def _on_stop(self, signum: int, _: Any) -> None:
        if self._stop and not self._stopping_now:
            print(f"kvscope: {signal.Signals(signum).name} again", flush=True)
            self._stopping_now = True
            raise _StopNow
        self._stop = True
        self._wake.set()

    def _on_roll(self, *_: Any) -> None:
        self._rolls += 1
        self._wake.set()

    def wait(self) -> str:
        while not (self._stop or self._rolls):
            self._wake.wait()
            self._wake.clear()
        if self._stop:
            return "stop"
        self._rolls = 0
        return "roll"


def _local(host: str) -> str:
    """Where a replica on this node reaches the proxy that listens on `host`."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _free_port(host: str) -> int:
    sock = bind_socket(host, 0)
    try:
        return int(sock.getsockname()[1])
    finally:
        sock.close()
