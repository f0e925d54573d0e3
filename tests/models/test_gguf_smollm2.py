"""A real GGUF file: SmolLM2-135M-Instruct in Q4_1 (llama.cpp's converter, llama
architecture, tokenizer "gpt2" with the "smollm" pre-tokenizer), fetched once by the
`smollm2_gguf` fixture (tests/conftest.py).

Against `transformers`' own GGUF loading of the same file: the tokenizer encodes a
corpus (prose, unicode, code, special tokens, chat markup) to the same ids, the chat
template renders the same text, and greedy decoding of the model dequantized to
float32 gives the same tokens. Served by an engine at its default dtype, it answers
that the capital of France is Paris.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvscope.models.loader import LoadedModel, load_model

from .test_parity import generate_all, hf_greedy

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it? I'll see "
    "you're done by 10:45 on 2026-12-05, or we'd pay $1,234.56 (about 15%).",
    "Unicode: café, naïve, Ångström, Straße; 日本語のテキスト; 한국어; русский текст; "
    "العربية; emoji 😀👍🏽 and a zero\u200bwidth space.",
    'def fibonacci(n: int) -> int:\n    """Return the n-th number."""\n    a, b = 0, 1\n'
    "    for _ in range(n):\n\ta, b = b, a + b  # tab-indented\n    return a\n\n\n"
    "if __name__ == '__main__':\n    print(fibonacci(30))",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|endoftext|><repo_name>kvscope<file_sep>README.md  trailing   spaces   \n\n\n  ",
    "   leading spaces, CAPITALS, MiXeD cAsE, snake_case, camelCase, kebab-case, "
    "URL https://example.com/a?b=c&d=e#f, e-mail someone@example.org.",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you?"},
    ],
]

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def ours(smollm2_gguf: Path) -> LoadedModel:
    return load_model(str(smollm2_gguf), device=CPU, dtype="float32")


@pytest.fixture(scope="module")
def their_tokenizer(smollm2_gguf: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    )


def test_the_config_is_smollm2s(ours: LoadedModel) -> None:
    c = ours.config
    assert (c.architecture, c.num_layers, c.hidden_size) == ("llama", 30, 576)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49_152)
    assert c.tie_word_embeddings and c.rope_theta == 100_000.0
    assert ours.tokenizer.eos_token_ids == (2,)


def test_the_tokenizer_encodes_as_transformers(ours: LoadedModel, their_tokenizer: Any) -> None:
    for text in CORPUS:
        ids = ours.tokenizer.encode(text)
        assert ids == their_tokenizer(text)["input_ids"], text
        assert ours.tokenizer.decode(ids) == their_tokenizer.decode(ids, skip_special_tokens=True)
    assert ours.tokenizer.encode("<|im_start|>") == [1]


def test_the_chat_template_renders_as_transformers(ours: LoadedModel, their_tokenizer: Any) -> None:
    for chat in CHATS:
        for prompt in (True, False):
            theirs = their_tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=prompt
            )
            assert ours.render_chat(chat, add_generation_prompt=prompt) == theirs


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_greedy_tokens_match_transformers(
    ours: LoadedModel, smollm2_gguf: Path, open_engine: Any
) -> None:
    """Greedy decoding of the model dequantized to float32, on a few prompts and a
    chat, run together in one engine."""
    prompts = [ours.tokenizer.encode(text) for text in PROMPTS] + [ours.encode_chat(CHATS[0])]
    got = await generate_all(open_engine, smollm2_gguf, prompts)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    assert got == [hf_greedy(hf, ids) for ids in prompts]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_engine_on_the_file_knows_the_capital_of_france(
    smollm2_gguf: Path, open_engine: Any
) -> None:
    async with open_engine(str(smollm2_gguf)) as engine:
        assert engine.loaded.model.dtype == torch.bfloat16  # a quantized file's default
        ids = engine.loaded.encode_chat(CHATS[0])
        out = await engine.generate(ids, temperature=0, max_tokens=24)
    assert "Paris" in out.text, out.text
