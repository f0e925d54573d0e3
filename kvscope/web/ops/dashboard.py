"""`GET /`: the live dashboard, a static page (`dashboard/index.html` and its script)
that polls `/stats` and `/requests`, draws KV usage over time with each cancel marked,
shows tokens/s per live request and their sum, and offers a cancel button per request. The page holds no data, so it needs no key; it asks for
one and sends it with its API calls when the server has keys.
"""

from __future__ import annotations

from pathlib import Path

from quart import Blueprint, Response, send_from_directory
from quart_schema import hide

DASHBOARD_DIR = Path(__file__).parent / "dashboard"

blueprint = Blueprint("dashboard", __name__)


@blueprint.get("/")
@hide
async def index() -> Response:
    """The dashboard page."""
    return await send_from_directory(DASHBOARD_DIR, "index.html")


@blueprint.get("/dashboard/<path:name>")
@hide
async def asset(name: str) -> Response:
    """The dashboard's script and style."""
    return await send_from_directory(DASHBOARD_DIR, name)
