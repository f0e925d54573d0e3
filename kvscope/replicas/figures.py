"""`python -m kvscope.replicas.figures`: what each cancel path costs through Ray Serve,
next to the single server.

Starts `kvscope serve` (one process) and then `kvscope serve --replicas 2` (Ray Serve)
on 127.0.0.1 with the bundled model and an audit log, and for each runs, one request
at a time on otherwise idle servers (so the figures are the path's own cost, not
queueing):

* `DELETE /requests/{id}` of a running job: the client's round trip, and the
  CancelReport's `release_seconds` (cancel call -> blocks back in the pool);
* closing an SSE stream after its second token: from the client's close to the
  replica's cancel (the audit line's `cancelled` wall-clock stamp, same machine
  clock), and from that cancel to the release (`released - cancelled`).

It prints a table and writes `docs/benchmarks/scale-out.json`. Wall-clock figures on a
shared 2-core machine are noisy; the load average before and after is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from kvscope.web.server import bind_socket

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "scale-out.json"))
    parser.add_argument("--work", default="/tmp/kvscope-scale-out")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"load_before": os.getloadavg(), "rounds": args.rounds, "runs": {}}
    for name, extra in (("single", []), ("ray-2-replicas", ["--replicas", "2", "--ray-cpus", "4"])):
        result["runs"][name] = measure(name, extra, args.rounds, work)
    result["load_after"] = os.getloadavg()
    result["revision"] = revision()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


def measure(name: str, extra: list[str], rounds: int, work: Path) -> dict[str, Any]:
    audit = work / f"audit-{name}.jsonl"
    audit.unlink(missing_ok=True)
    port = free_port()
    command = [sys.executable, "-m", "kvscope.cli", "serve", "--port", str(port)]
    command += ["--num-kv-blocks", "64", "--model-threads", "1", "--log-level", "WARNING"]
    command += ["--audit-log", str(audit), *extra]
    with serving(command, work / f"{name}.log") as process:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            wait_ready(client, process, replicas=2 if extra else 0)
            deletes = [_delete_round(client) for _ in range(rounds)]
            closes = [_close_round(client) for _ in range(rounds)]
    records = {r["id"]: r for r in map(json.loads, audit.read_text().splitlines())}
    disconnect = [records[i]["cancelled"] - closed for i, closed in closes]
    release = [records[i]["released"] - records[i]["cancelled"] for i, _ in closes]
    return {
        "delete_round_trip_s": _summary([rt for rt, _ in deletes]),
        "delete_release_s": _summary([rel for _, rel in deletes]),
        "disconnect_to_cancel_s": _summary(disconnect),
        "disconnect_cancel_to_release_s": _summary(release),
    }


def _delete_round(client: httpx.Client) -> tuple[float, float]:
    job = client.post("/generate", json={"prompt": "Once upon a time", **LONG}).json()["id"]
    while client.get(f"/requests/{job}").json()["tokens_generated"] < 2:
        time.sleep(0.01)
    started = time.perf_counter()
    report = client.delete(f"/requests/{job}")
    round_trip = time.perf_counter() - started
    assert report.status_code == 200, report.text
    return round_trip, report.json()["release_seconds"]


def _close_round(client: httpx.Client) -> tuple[str, float]:
    body = {"prompt": "Tell me a story", "stream": True, **LONG}
    with client.stream("POST", "/generate", json=body) as stream:
        tokens = 0
        for line in stream.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                tokens += event["type"] == "token"
                if tokens == 2:
                    break
        closed = time.time()
    request_id = event["id"]
    while client.get(f"/requests/{request_id}").json()["status"] != "cancelled":
        time.sleep(0.01)
    return request_id, closed


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1000,
        "max_ms": ordered[-1] * 1000,
    }


def table(result: dict[str, Any]) -> str:
    rows = ["| path | figure | " + " | ".join(result["runs"]) + " |"]
    rows.append("| --- | --- |" + " --- |" * len(result["runs"]))
    labels = {
        "delete_round_trip_s": ("DELETE", "client round trip"),
        "delete_release_s": ("DELETE", "cancel -> release"),
        "disconnect_to_cancel_s": ("SSE close", "client close -> cancel"),
        "disconnect_cancel_to_release_s": ("SSE close", "cancel -> release"),
    }
    for key, (path, figure) in labels.items():
        cells = [
            f"{run[key]['p50_ms']:.1f} / {run[key]['p99_ms']:.1f}"
            for run in result["runs"].values()
        ]
        rows.append(f"| {path} | {figure} (p50 / p99 ms) | " + " | ".join(cells) + " |")
    return "\n".join(rows)


@contextmanager
def serving(command: list[str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run `kvscope serve` (`command`) for the block, its output in `log_path`; stop it
    with SIGINT at the end (SIGKILL to its process group after 120 s)."""
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield process
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def wait_ready(client: httpx.Client, process: subprocess.Popen[bytes], replicas: int) -> None:
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("the server exited; see its log")
        try:
            stats = client.get("/stats").json()
            if not replicas or len(stats.get("replicas", {})) == replicas:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not start")


def free_port() -> int:
    sock = bind_socket("127.0.0.1", 0)
    try:
        return int(sock.getsockname()[1])
    finally:
        sock.close()


def revision() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
