"""`kvscope serve --speculative-config` as vLLM takes it, on the real SmolLM2 model: the
OpenAI routes answer with speculation on (streamed as not), and `/metrics` and `/stats`
count the drafts and accepted tokens under vLLM's names and kvscope's own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from .conftest import served

CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"


def _metric(text: str, name: str) -> float:
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert values, f"{name} not in /metrics"
    return sum(float(v) for v in values)


def test_served_with_ngram_speculation(smollm2_gguf: Path) -> None:
    spec = json.dumps(CONFIG)
    with served("asyncio", "--speculative-config", spec, model=str(smollm2_gguf)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ask = {
            "model": client.models.list().data[0].id,
            "messages": [{"role": "user", "content": f"Repeat this code exactly:\n\n{CODE}"}],
            "temperature": 0,
            "max_tokens": 48,
        }
        # The first computes the prompt afresh, the others after its cached prefix,
        # which may round otherwise: compare two of the latter.
        client.chat.completions.create(**ask)
        whole = client.chat.completions.create(**ask)
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(**ask, stream=True)
            if chunk.choices
        )
        assert whole.choices[0].message.content == streamed
        assert "return a + b" in streamed
        metrics = httpx.get(url + "/metrics", timeout=30).text
        accepted = _metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
        assert accepted > 0
        assert _metric(metrics, "vllm:spec_decode_num_draft_tokens_total") >= accepted
        assert _metric(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
        assert 0 < _metric(metrics, "kvscope_spec_decode_acceptance_rate") <= 1
        stats = httpx.get(url + "/stats", timeout=30).json()
        assert stats["spec_decode_num_accepted_tokens"] == accepted


def test_a_draft_model_is_refused_naming_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvscope.cli", "serve", "--model", "tiny-random"]
        + ["--speculative-config", '{"model": "some/draft", "num_speculative_tokens": 3}'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "draft model 'some/draft'" in done.stderr
