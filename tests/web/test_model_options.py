"""What a vLLM user passes about the model, on the real server: the name it is served
as (`--served-model-name`), a chat template in place of the checkpoint's
(`--chat-template`, the template or a file), the model as `kvscope serve MODEL`, and
a `vllm serve` command line as it is."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from kvscope import Engine
from kvscope.models.errors import ModelLoadError
from kvscope.models.loader import BUNDLED_DIR

from .conftest import ROOT, running_server, serve_cli, wait_clean

TEMPLATE = "X{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}Y"
HI = [{"role": "user", "content": "hi"}]


def test_the_served_name_and_the_template_given(backend: str, tmp_path: Path) -> None:
    with running_server(
        backend, tmp_path, served_model_name="my-llm", chat_template=TEMPLATE
    ) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["my-llm"]
        out = client.chat.completions.create(model="my-llm", messages=HI, max_tokens=2)  # type: ignore[arg-type]
        assert out.model == "my-llm"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="tiny-random", prompt="x", max_tokens=1)
        with live.client() as http:
            tokens = http.post("/tokenize", json={"messages": HI}).json()["tokens"]
            text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
        assert text == "X[user:hi]Y"
        client.close()
        wait_clean(live)


@pytest.mark.anyio
async def test_a_template_file_is_read_and_a_bad_one_refused(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    async with Engine.open("tiny-random", device="cpu", chat_template=str(path)) as engine:
        assert engine.loaded.render_chat(HI) == "X[user:hi]Y"
    for bad, said in (("{% for %}", "does not compile"), (str(tmp_path / "none"), "no file")):
        with pytest.raises(ModelLoadError, match=said):
            async with Engine.open("tiny-random", device="cpu", chat_template=bad):
                pass


def test_kvscope_serve_takes_the_model_as_vllm_serve_does() -> None:
    command = [sys.executable, "-m", "kvscope.cli", "serve", "tiny-random", "--device", "cpu"]
    process = subprocess.Popen(
        [*command, "--port", "0", "--worker", "thread"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("kvscope serving tiny-random on "), line
        url = line.split(" on ")[1].split()[0]
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["tiny-random"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    twice = subprocess.run(
        [*command, "--model", "bundled"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert twice.returncode == 2 and "given twice" in twice.stderr


def test_a_vllm_serve_command_line_runs_as_it_is() -> None:
    """vLLM's flags for what kvscope always does are accepted; `--disable-log-requests`
    leaves out the per-request lines; what kvscope cannot do is a clear error."""
    vllm_flags = [
        "--host", "127.0.0.1", "--max-model-len", "256", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--trust-remote-code", "--enforce-eager",
        "--enable-chunked-prefill", "--enable-prompt-tokens-details", "-tp", "1",
        "--pipeline-parallel-size", "1", "--disable-log-requests",
        "--allowed-origins", '["http://app.example", "http://two.example"]',
    ]  # fmt: skip
    process, url = serve_cli(
        "asyncio", "tiny-random", "--worker", "thread", *vllm_flags, model=None
    )
    try:
        answer = httpx.post(
            url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 3},
            headers={"Origin": "http://two.example"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["access-control-allow-origin"] == "http://two.example"
        process.send_signal(signal.SIGTERM)
        _, log = process.communicate(timeout=60)
        assert process.returncode == 0, log[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "kvscope listening on" in log  # the log is there, without request lines
    assert "request start" not in log and "request finish" not in log
    command = [sys.executable, "-m", "kvscope.cli", "serve", "tiny-random", "--device", "cpu"]
    for flag in ("-tp", "--pipeline-parallel-size"):
        refused = subprocess.run(
            [*command, flag, "2"], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert refused.returncode == 2 and "--replicas" in refused.stderr, refused.stderr


def test_the_sampling_defaults_come_from_where_generation_config_says(
    backend: str, tmp_path: Path
) -> None:
    """vLLM's `--generation-config` (`auto`: the checkpoint's; `vllm`: none; a
    directory's) and `--override-generation-config` laid over: what a request that
    leaves the field out samples with (shown by a response, and greedy when the
    defaults say temperature 0)."""
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_DIR, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": 0.8}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    cases = [
        ({}, (0.3, 0.8)),
        ({"generation_config": "vllm"}, (1.0, 1.0)),
        ({"generation_config": str(other)}, (0.7, 1.0)),
        ({"override_generation_config": '{"top_p": 0.5}'}, (0.3, 0.5)),
    ]
    for options, shown in cases:
        with running_server(backend, tmp_path, model=str(model), **options) as live:
            with live.client() as http:
                answer = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1})
                assert answer.status_code == 200, answer.text
                assert (answer.json()["temperature"], answer.json()["top_p"]) == shown, options
            wait_clean(live)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 1.5}))
    asked = {"prompt": "def f(", "max_tokens": 12, "ignore_eos": True}
    for override, kinds in ((None, 3), ('{"temperature": 0}', 1)):
        with running_server(
            backend, tmp_path, model=str(model), override_generation_config=override
        ) as live:
            with live.client() as http:
                texts = {
                    http.post("/v1/completions", json={**asked, **more}).json()["choices"][0][
                        "text"
                    ]
                    for more in ({"seed": 1}, {"seed": 2}, {"temperature": 0})
                }
            # The checkpoint's 1.5 samples; the override's 0 is greedy, whatever the seed.
            assert len(texts) == kinds, (override, texts)
            wait_clean(live)


@pytest.mark.anyio
async def test_bad_generation_settings_are_refused_at_open() -> None:
    for options, said in (
        ({"override_generation_config": '{"max_tokens": 5}'}, "max_tokens"),
        ({"override_generation_config": "{"}, "not JSON"),
        ({"override_generation_config": '{"temperature": -1}'}, "temperature"),
        ({"generation_config": "/nowhere"}, "no generation_config.json"),
    ):
        with pytest.raises(ModelLoadError, match=said):
            async with Engine.open("tiny-random", device="cpu", **options):
                pass
