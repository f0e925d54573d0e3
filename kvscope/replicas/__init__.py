"""kvscope replicas on Ray Serve (the `kvscope[ray]` extra).

    from ray import serve
    from kvscope.replicas import build_app

    serve.run(build_app({"model": "bundled"}, replicas=2), route_prefix="/")

or `serve run kvscope.replicas:app_builder replicas=2 model=bundled`, or
`kvscope serve --replicas 2`. Each replica is one `Engine` with its own block pool,
serving the single server's routes; ids name their replica, so every cancel path
reaches the owner in one hop. See docs/scale-out.md.
"""

from __future__ import annotations

try:
    import ray.serve  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the extra
    raise ImportError("kvscope.replicas needs Ray Serve: pip install 'kvscope[ray]'") from exc

from typing import Any

__all__ = ["DEPLOYMENT", "KvscopeReplica", "app_builder", "build_app"]


def __getattr__(name: str) -> Any:
    # Lazily: Serve's proxy imports `kvscope.replicas.router` and `.proxy` only, and
    # need not load the web app with them.
    if name in __all__:
        from . import deployment

        return getattr(deployment, name)
    raise AttributeError(name)
