"""Chat templates render to exactly the string transformers' `apply_chat_template`
gives, for Llama 3, Qwen2 (ChatML), Mistral-style and a template that uses every
global and extension transformers provides; a template's `raise_exception` becomes
`ChatTemplateError`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvscope.errors import InvalidRequest
from kvscope.models.chat import ChatTemplateError, render_chat
from kvscope.models.loader import load_model

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Multi-line, so trim_blocks / lstrip_blocks matter; uses namespace, tojson, dict,
# loop controls, the generation tag, tools, reasoning aliases and strftime_now.
KITCHEN_SINK = """\
{%- set ns = namespace(count=0, system='') -%}
{%- if tools %}
Tools: {{ tools | tojson }}
{% endif %}
{% for message in messages %}
    {% if message.role == 'system' %}
        {% set ns.system = message.content %}
        {% continue %}
    {% endif %}
    {% set ns.count = ns.count + 1 %}
    {% if ns.count > 4 %}{% break %}{% endif %}
<{{ message.role }}>{% if message.thinking is defined %}[think: {{ message.reasoning_content }}]{% endif %}
    {% if message.role == 'assistant' %}
{% generation %}{{ message.content }}{% endgeneration %}{{ eos_token }}
    {% else %}
{{ message.content | tojson }} {{ dict(a=1, b=ns.count) | tojson(sort_keys=True) }}
    {% endif %}
{% endfor %}
system={{ ns.system }} today={{ strftime_now('%Y') }} pad={{ pad_token }}
{%- if add_generation_prompt %}
<assistant>
{%- endif %}
"""

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "tool_calls": None},
        {"role": "user", "content": "  What is 2+2? {{ not evaluated }} émigré 🙂 <html>&  "},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two", "reasoning": "counting"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "five"},
        {"role": "assistant", "content": "six"},
    ],
]

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoints: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoints("llama")))


def theirs(tokenizer: Any, template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


def ours(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    tokens = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    return render_chat(template, messages, **{**tokens, **kwargs})


@pytest.mark.parametrize(
    "template", [LLAMA3, QWEN2, KITCHEN_SINK], ids=["llama3", "qwen2", "kitchen-sink"]
)
@pytest.mark.parametrize("messages", CHATS, ids=["one", "system", "long"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(
    hf_tokenizer: Any, template: str, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    expected = theirs(hf_tokenizer, template, messages, add_generation_prompt=add_generation_prompt)
    assert ours(template, messages, add_generation_prompt=add_generation_prompt) == expected


def test_tools_and_template_variables_match_transformers(hf_tokenizer: Any) -> None:
    messages = CHATS[1]
    expected = theirs(hf_tokenizer, KITCHEN_SINK, messages, tools=TOOLS, add_generation_prompt=True)
    assert ours(KITCHEN_SINK, messages, tools=TOOLS) == expected
    assert "Tools: [{" in expected


def test_mistral_style_template_and_its_exceptions(hf_tokenizer: Any) -> None:
    good = [m for m in CHATS[2]]
    assert ours(MISTRAL, good) == theirs(hf_tokenizer, MISTRAL, good)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="roles must alternate"):
        theirs(hf_tokenizer, MISTRAL, bad)
    with pytest.raises(ChatTemplateError, match="roles must alternate") as caught:
        ours(MISTRAL, bad)
    assert isinstance(caught.value, InvalidRequest)  # the web layer answers 400


def test_sandbox_refuses_escapes() -> None:
    escape = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        ours(escape, CHATS[0])
    with pytest.raises(ChatTemplateError):
        ours("{% set ns = namespace() %}{% set ns._x = 1 %}", CHATS[0])


def test_empty_chat_is_refused() -> None:
    with pytest.raises(ChatTemplateError, match="at least one message"):
        ours(QWEN2, [])


@pytest.mark.parametrize("where", ["tokenizer_config", "jinja_file"])
def test_checkpoint_template_renders_and_encodes_as_transformers(
    checkpoints: Any, tmp_path: Path, where: str
) -> None:
    from transformers import AutoTokenizer

    directory = tmp_path / "chat"
    shutil.copytree(checkpoints("qwen2"), directory)
    if where == "jinja_file":
        (directory / "chat_template.jinja").write_text(QWEN2)
    else:
        path = directory / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": QWEN2}))
    loaded = load_model(str(directory), device=torch.device("cpu"), dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    for messages in CHATS:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert loaded.render_chat(messages) == text
        ids = tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert loaded.encode_chat(messages) == list(ids)
