"""Fixtures for the Ray Serve tests: `kvscope serve --replicas 2` on a local Ray.

One cluster per test session (starting Ray and loading two engines takes a minute on
this machine): the `kvscope serve --replicas 2` command in a subprocess, which starts
a small local Ray (4 logical CPUs, no dashboard), deploys two replicas of a long-context
copy of the bundled model (see `long_context_model`) with a LoRA adapter (`sql`, see
`lora_adapter`), and on SIGINT stops Serve (each replica drains) and Ray. Every test ends with a leak check on every replica: no block in use, no live
request, no request task. Tests talk to it with real clients through Serve's proxy.
Each test module skips, saying why, when Ray Serve is not installed (this file
imports no Ray).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from kvscope.web.server import bind_socket
from tests.web.conftest import wait_for as web_wait_for

ROOT = Path(__file__).resolve().parents[2]
REPLICAS = 2
#: Whole-cluster start: Ray, Serve, two model loads, on 2 shared cores.
START_TIMEOUT = 300.0
#: Each replica's `--drain-timeout`: a rolling redeploy lets streams run this long.
DRAIN_TIMEOUT = 3.0
#: Positions of the served copy of the bundled model, and tokens of each replica's pool.
LONG_CONTEXT = 16384
#: A request that runs for minutes unless cancelled: a test's roll or fault takes ~10-20
#: s, and a 1,000-token stream (the bundled model's limit) ended on its own before a
#: rolling redeploy had drained its replica about one run in five.
LONG = {"max_tokens": LONG_CONTEXT - 64, "ignore_eos": True, "temperature": 0}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.ray)


#: Polls through Ray's proxy get a longer deadline than the single server's.
wait_for = functools.partial(web_wait_for, timeout=30.0)


@attrs.define
class Cluster:
    process: subprocess.Popen[str]
    url: str
    log_path: Path
    #: What every replica serves: the model's directory, and the `sql` adapter's.
    model: Path
    adapter: Path

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://")

    def replicas(self) -> dict[str, dict[str, Any]]:
        """Each replica's `/stats` (name -> figures, pid included)."""
        with self.client() as client:
            return client.get("/stats").json()["replicas"]

    def wait_replicas(self, n: int = REPLICAS, timeout: float = START_TIMEOUT) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            if self.process.poll() is not None:
                raise AssertionError(f"kvscope serve exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                replicas = self.replicas()
            except (httpx.HTTPError, ValueError, KeyError):
                return None
            return replicas if len(replicas) == n else None

        return wait_for(ready, timeout=timeout, what=f"{n} replicas serving")

    def wait_clean(self) -> None:
        """Every replica: no KV block in use, no live request, no request task."""

        def clean() -> bool:
            replicas = self.replicas()
            return len(replicas) == REPLICAS and all(
                s["kv_blocks_in_use"] == 0 and s["live_requests"] == 0 and s["tasks"] == 0
                for s in replicas.values()
            )

        try:
            wait_for(clean, timeout=30, what="every replica clean")
        except AssertionError:
            raise AssertionError(f"a replica leaked: {self.replicas()}") from None


def read_events(client: Any, body: dict[str, Any], replica: str, out: dict[str, Any]) -> None:
    """Stream `body` on `replica` in `out["events"]` (a cut connection in `out["error"]`)."""
    events: list[dict[str, Any]] = []
    out["events"] = events
    try:
        with client.stream(
            "POST", "/generate", json=body, headers={"X-Kvscope-Replica": replica}
        ) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
    except Exception as exc:  # the connection cut is what some tests expect
        out["error"] = exc


def _free_port() -> int:
    sock = bind_socket("127.0.0.1", 0)
    try:
        return int(sock.getsockname()[1])
    finally:
        sock.close()


def long_context_model(directory: Path) -> Path:
    """The bundled model's files with `max_position_embeddings` raised to LONG_CONTEXT
    (rotary positions extend; the text past 1,024 tokens is of no interest here)."""
    bundled = ROOT / "kvscope" / "models" / "bundled"
    directory.mkdir(parents=True, exist_ok=True)
    for source in bundled.iterdir():
        (directory / source.name).symlink_to(source)
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        settings = json.loads((bundled / name).read_text())
        settings[key] = LONG_CONTEXT
        (directory / name).unlink()
        (directory / name).write_text(json.dumps(settings, indent=2))
    return directory


def lora_adapter(directory: Path, model: Path) -> Path:
    """A LoRA adapter of the model's q and v projections as PEFT saves one (random A
    and B, rank 4), written with safetensors alone: Ray's tests need no peft."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    hidden, rank = config["hidden_size"], 4
    outputs = {
        "q": config["num_attention_heads"] * config["head_dim"],
        "v": config["num_key_value_heads"] * config["head_dim"],
    }
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for part, out_features in outputs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{part}_proj"
            for half, shape in (("A", (rank, hidden)), ("B", (out_features, rank))):
                tensors[f"{key}.lora_{half}.weight"] = 0.3 * torch.randn(
                    *shape, generator=generator
                )
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
    }
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    return directory


def launch(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    """Start `kvscope serve --replicas 2` in a session of its own (its process group:
    Ray's processes with it) and wait until both replicas serve."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("ray") / "serve.log"
    model = long_context_model(tmp_path_factory.mktemp("long-context-model"))
    adapter = lora_adapter(tmp_path_factory.mktemp("lora") / "sql", model)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvscope.cli", "serve", "--replicas", str(REPLICAS)]
            + ["--port", str(port), "--ray-cpus", "4", "--model", str(model)]
            + ["--kv-cache-tokens", str(LONG_CONTEXT)]
            + ["--drain-timeout", str(DRAIN_TIMEOUT), "--lora-modules", f"sql={adapter}"]
            + ["--model-threads", "1", "--log-level", "WARNING"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # Ray's own processes go with it at the end
        )
    running = Cluster(process, f"http://127.0.0.1:{port}", log_path, model, adapter)
    try:
        running.wait_replicas()
    except BaseException as exc:
        stop(running)
        if isinstance(exc, AssertionError):
            log_tail = log_path.read_text()[-3000:]
            raise AssertionError(f"cluster did not start:\n{log_tail}") from None
        raise
    return running


def stop(cluster: Cluster, signum: int = signal.SIGINT) -> None:
    """Stop `kvscope serve` with `signum` (it drains); kill its process group if it hangs."""
    if cluster.process.poll() is None:
        cluster.process.send_signal(signum)
    try:
        cluster.process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(cluster.process.pid, signal.SIGKILL)
        cluster.process.wait()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    running = launch(tmp_path_factory)
    try:
        yield running
    finally:
        stop(running)


@pytest.fixture
def live(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, with a leak check on every replica after the test."""
    cluster.wait_replicas()
    yield cluster
    cluster.wait_clean()
