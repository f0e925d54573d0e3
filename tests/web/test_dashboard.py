"""The dashboard at GET /, in headless Chromium driven over the DevTools protocol.

The page must list a live request, show KV usage, and its cancel button must cancel
the request (reason `user`), without a script error. Skipped where Debian's
`chromium` is not installed.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from .conftest import LONG, Live, wait_clean, wait_for, wait_status, wait_tokens

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)"
)


class Page:
    """A Chromium page over the DevTools protocol: just `evaluate`."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._ids = itertools.count(1)

    def evaluate(self, expression: str) -> Any:
        call_id = next(self._ids)
        self._ws.send(
            json.dumps(
                {
                    "id": call_id,
                    "method": "Runtime.evaluate",
                    "params": {"expression": expression, "returnByValue": True},
                }
            )
        )
        while True:
            message = json.loads(self._ws.recv(timeout=30))
            if message.get("id") == call_id:
                result = message["result"]
                assert "exceptionDetails" not in result, result
                return result["result"].get("value")


def _open_page(url: str, profile: Path) -> tuple[subprocess.Popen[bytes], str]:
    assert CHROMIUM is not None
    browser = subprocess.Popen(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            url,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    port_file = profile / "DevToolsActivePort"
    port = wait_for(
        lambda: port_file.exists() and port_file.read_text().split("\n")[0],
        timeout=60,
        what="chromium",
    )

    def page_target() -> str | None:
        try:
            targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
        except httpx.HTTPError:
            return None
        return next(
            (
                t["webSocketDebuggerUrl"]
                for t in targets
                if t["type"] == "page" and t["url"].startswith(url)
            ),
            None,
        )

    try:
        return browser, wait_for(page_target, timeout=60, what="the dashboard page")
    except BaseException:
        browser.kill()
        browser.wait()
        raise


@pytest.mark.parametrize("backend", ["asyncio"])
def test_dashboard_lists_and_cancels(live: Live, tmp_path: Path) -> None:
    with live.client() as client:
        assert "kvscope" in client.get("/").text
        assert client.get("/dashboard/app.js").status_code == 200
        job = client.post("/generate", json={"prompt": "dashboard", **LONG}).json()
        wait_tokens(client, job["id"])
        browser, ws_url = _open_page(live.url + "/", tmp_path / "profile")
        try:
            with connect(ws_url, max_size=None) as ws:
                page = Page(ws)
                selector = json.dumps(f'button[data-cancel="{job["id"]}"]')
                wait_for(
                    lambda: page.evaluate(f"!!document.querySelector({selector})"),
                    what="the request's row",
                )
                kv = page.evaluate("document.getElementById('kv-in-use').textContent")
                assert kv.endswith("/ 1024") and int(kv.split("/")[0]) >= 1
                wait_for(
                    lambda: float(page.evaluate("document.getElementById('tps').textContent")) > 0,
                    what="tokens/s",
                )
                page.evaluate(f"document.querySelector({selector}).click()")
                info = wait_status(client, job["id"])
                assert info["status"] == "cancelled" and info["cancel_reason"] == "user"
                wait_for(
                    lambda: not page.evaluate(f"!!document.querySelector({selector})"),
                    what="the row to go",
                )
                assert page.evaluate("window.__dashboardErrors") == []
                assert page.evaluate("document.getElementById('error').textContent") == ""
        finally:
            browser.terminate()
            try:
                browser.wait(10)
            except subprocess.TimeoutExpired:
                browser.kill()
                browser.wait()
    wait_clean(live)
