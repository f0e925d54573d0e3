"""LoRA adapters on the real server, as vLLM serves them: `kvscope serve
--enable-lora --lora-modules ...` (on the model worker process) and the in-process
server, through the `openai` package and httpx.

An adapter is a model of its own name: `/v1/models` lists it with the served model as
its parent; a completion, a chat, a stream, an embedding or a native `/generate` that
names it runs with it, its tokens those of PEFT's model; a name that is neither is a
404 (a 400 on `/generate`, naming `lora`). A DELETE of an adapter's request ends it
and frees its blocks as any other.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.models.conftest import build_checkpoint

from .conftest import Live, running_server, serve_cli, sse_events, wait_clean, wait_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPT = "Once upon a time there was a small model"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("llama", tmp_path_factory.mktemp("lora") / "llama")


@pytest.fixture(scope="module")
def adapter(checkpoint: Path) -> tuple[Path, Any]:
    """A PEFT adapter of every projection (saved by PEFT) and its PEFT model."""
    from tests.models.test_lora import save_adapter

    hf = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    path = checkpoint.parent / "sql-adapter"
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = save_adapter(hf, path, 7, r=8, lora_alpha=16, target_modules=targets)
    return path, model


def greedy_text(model: Any, checkpoint: Path, prompt: str) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=2,
        )
    return tokenizer.decode(out[0, ids.shape[1] :])


@pytest.fixture(scope="module")
def expected(checkpoint: Path, adapter: tuple[Path, Any]) -> dict[str, str]:
    """The greedy continuation of `PROMPT` by PEFT's model and by the base model."""
    base = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    texts = {"sql": greedy_text(adapter[1], checkpoint, PROMPT)}
    texts["base"] = greedy_text(base, checkpoint, PROMPT)
    assert texts["sql"] != texts["base"]
    return texts


@pytest.fixture
def served(
    backend: str, tmp_path: Path, checkpoint: Path, adapter: tuple[Path, Any]
) -> Iterator[tuple[Live, openai.OpenAI]]:
    with (
        running_server(
            backend, tmp_path, model=str(checkpoint), lora_modules={"sql": str(adapter[0])}
        ) as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0, timeout=60) as client,
    ):
        yield live, client


def test_an_adapter_is_served_under_its_own_name(
    served: tuple[Live, openai.OpenAI],
    checkpoint: Path,
    adapter: tuple[Path, Any],
    expected: dict[str, str],
) -> None:
    live, client = served
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards) == [checkpoint.name, "sql"]
    assert cards["sql"].parent == checkpoint.name and cards["sql"].root == str(adapter[0])  # type: ignore[attr-defined]
    assert client.models.retrieve("sql").id == "sql"
    greedy = dict(temperature=0, max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})
    out = client.completions.create(model="sql", prompt=PROMPT, **greedy)  # type: ignore[arg-type]
    assert out.model == "sql" and out.choices[0].text == expected["sql"]
    base = client.completions.create(model=checkpoint.name, prompt=PROMPT, **greedy)  # type: ignore[arg-type]
    assert base.model == checkpoint.name and base.choices[0].text == expected["base"]
    streamed = client.completions.create(model="sql", prompt=PROMPT, stream=True, **greedy)  # type: ignore[arg-type]
    chunks = list(streamed)
    assert {c.model for c in chunks} == {"sql"}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["sql"]
    with live.client() as http:
        native = http.post(
            "/generate",
            json={
                "prompt": PROMPT,
                "lora": "sql",
                "temperature": 0,
                "max_tokens": NEW_TOKENS,
                "ignore_eos": True,
            },
        )
        assert native.status_code == 202, native.text
        done = wait_for(
            lambda: (
                (info := http.get(f"/requests/{native.json()['id']}").json())["status"]
                == "finished"
                and info
            ),
            what="the native request to finish",
        )
        assert done["text"] == expected["sql"]
        refused = http.post("/generate", json={"prompt": PROMPT, "lora": "nope"})
        assert refused.status_code == 400 and "no LoRA adapter 'nope'" in refused.text
    with pytest.raises(openai.NotFoundError, match="`sql`"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    embedded = {
        name: client.embeddings.create(model=name, input=PROMPT, encoding_format="float")
        for name in ("sql", checkpoint.name)
    }
    assert embedded["sql"].model == "sql"
    assert embedded["sql"].data[0].embedding != embedded[checkpoint.name].data[0].embedding
    wait_clean(live)


def test_a_delete_ends_an_adapters_stream_and_frees_its_blocks(
    served: tuple[Live, openai.OpenAI],
) -> None:
    live, _ = served
    with live.client() as http:
        body = {
            "model": "sql",
            "prompt": PROMPT,
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        }
        with http.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200, stream.read()
            request_id = stream.headers["X-Request-Id"]
            events = sse_events(stream.iter_lines())
            next(events)  # a token came: the request runs
            assert http.delete(f"/requests/{request_id}").status_code == 200
            rest = list(events)
        assert rest[-1] == "[DONE]"
        assert http.get(f"/requests/{request_id}").json()["status"] == "cancelled"
    wait_clean(live)


def test_kvscope_serve_takes_vllms_lora_options(
    checkpoint: Path, adapter: tuple[Path, Any], expected: dict[str, str]
) -> None:
    """`vllm serve`'s LoRA flags as they are (`name=path` and the JSON form), on the
    model worker process; an adapter the model cannot take stops the start with its
    reason."""
    as_json = json.dumps({"name": "json-sql", "path": str(adapter[0]), "base_model_name": "x"})
    process, url = serve_cli(
        "asyncio",
        str(checkpoint),
        "--enable-lora",
        "--lora-modules",
        f"sql={adapter[0]}",
        as_json,
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        model=None,
    )
    try:
        with openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60) as client:
            assert [card.id for card in client.models.list().data] == [
                checkpoint.name,
                "sql",
                "json-sql",
            ]
            for name in ("sql", "json-sql"):
                out = client.completions.create(
                    model=name,
                    prompt=PROMPT,
                    temperature=0,
                    max_tokens=NEW_TOKENS,
                    extra_body={"ignore_eos": True},
                )
                assert out.choices[0].text == expected["sql"]
        process.send_signal(signal.SIGTERM)
        _, log = process.communicate(timeout=60)
        assert process.returncode == 0, log[-3000:]
        assert "LoRA adapter 'sql'" in log and "rank 8" in log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_an_adapter_over_the_rank_limit_stops_the_start(
    checkpoint: Path, adapter: tuple[Path, Any]
) -> None:
    import subprocess
    import sys

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope.cli",
            "serve",
            str(checkpoint),
            "--device",
            "cpu",
            "--port",
            "0",
            "--lora-modules",
            f"sql={adapter[0]}",
            "--max-lora-rank",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "rank 8 is over max_lora_rank (4)" in run.stderr, run.stderr[-2000:]
    bad = subprocess.run(
        [sys.executable, "-m", "kvscope.cli", "serve", str(checkpoint), "--lora-modules", "sql"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "'sql' is not NAME=PATH" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_adapters_load_and_unload_at_run_time(
    backend: str,
    tmp_path: Path,
    checkpoint: Path,
    adapter: tuple[Path, Any],
    expected: dict[str, str],
    worker: str,
) -> None:
    """vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`: a loaded adapter
    serves at once (in the model worker process too, which the next step tells); one
    in use is not unloaded; an unloaded one is a 404 and its name can serve again."""
    greedy = {"prompt": PROMPT, "temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True}
    with (
        running_server(
            backend, tmp_path, model=str(checkpoint), worker=worker, runtime_lora_updating=True
        ) as live,
        live.client() as http,
    ):
        if worker == "process":
            wait_for(lambda: live.stats()["worker_pid"], what="the model worker", timeout=120)

        def completion(model: str) -> httpx.Response:
            return http.post("/v1/completions", json={"model": model, **greedy})

        assert completion("sql").status_code == 404
        assert "vllm:lora_requests_info" not in http.get("/metrics").text  # none served
        loaded = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter[0])}
        )
        assert loaded.status_code == 200, loaded.text
        assert loaded.text == "Success: LoRA adapter 'sql' added successfully."
        assert "sql" in [card["id"] for card in http.get("/v1/models").json()["data"]]
        assert completion("sql").json()["choices"][0]["text"] == expected["sql"]
        again = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter[0])}
        )
        assert again.status_code == 409 and "already loaded" in again.text
        missing = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}
        )
        assert missing.status_code == 400 and "no adapter_config.json" in missing.text
        named_as_model = http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": checkpoint.name, "lora_path": str(adapter[0])},
        )
        assert named_as_model.status_code == 400 and "model's own name" in named_as_model.text
        body = {"model": "sql", "prompt": PROMPT, "max_tokens": 400, "stream": True}
        with http.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as stream:
            request_id = stream.headers["X-Request-Id"]
            events = sse_events(stream.iter_lines())  # kept: closing it would disconnect
            next(events)  # it runs
            busy = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert busy.status_code == 409 and "1 live request" in busy.text
            metrics = http.get("/metrics").text
            assert 'kvscope_lora_requests{adapter="sql"} 1.0' in metrics
            assert (
                'vllm:lora_requests_info{max_lora="1",running_lora_adapters="sql",'
                'waiting_lora_adapters=""}' in metrics
            )
            assert http.delete(f"/requests/{request_id}").status_code == 200
        wait_clean(live)
        assert 'kvscope_lora_requests{adapter="sql"} 0.0' in http.get("/metrics").text
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert unloaded.status_code == 200, unloaded.text
        assert 'adapter="sql"' not in http.get("/metrics").text
        assert completion("sql").status_code == 404
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 404
        http.post("/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": str(adapter[0])})
        assert completion("sql2").json()["choices"][0]["text"] == expected["sql"]
        assert completion(checkpoint.name).json()["choices"][0]["text"] == expected["base"]
        assert live.stats()["worker_restarts"] == 0


def test_runtime_loading_is_off_unless_switched_on(served: tuple[Live, openai.OpenAI]) -> None:
    live, _ = served
    with live.client() as http:
        refused = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/"})
        assert refused.status_code == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in refused.text


def test_runtime_loading_is_refused_with_replicas(checkpoint: Path) -> None:
    """Each replica holds its own adapters: a load would reach one of them."""
    import os
    import subprocess
    import sys

    pytest.importorskip("ray")
    run = subprocess.run(
        [sys.executable, "-m", "kvscope.cli", "serve", str(checkpoint), "--replicas", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    assert run.returncode == 2 and "--lora-modules" in run.stderr, run.stderr[-2000:]
