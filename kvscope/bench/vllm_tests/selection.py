"""Which of vLLM's OpenAI-entrypoint test files run, and why the others do not
(docs/vllm-tests.md, "Which files").

Paths are relative to vLLM's `tests/entrypoints/openai/`; an entry may name one test
(`file.py::test_name`). The default set is every file that starts a server and asks it
about the OpenAI surface in a way a 135M Llama chat model can answer; `SKIPPED` says for
each other file why not. Tests inside a chosen file that never reach a server (unit
tests of vLLM's own classes) are left out when the run collects them (`pytest_plugin`).
"""

from __future__ import annotations

from pathlib import Path

#: Where the files are, below the sdist's root.
OPENAI_TESTS = Path("tests/entrypoints/openai")

#: The files (or tests) run by default.
DEFAULT = (
    "chat_completion/test_chat.py",
    "chat_completion/test_chat_completion.py",
    "chat_completion/test_chat_echo.py",
    "chat_completion/test_chat_logit_bias_validation.py",
    "chat_completion/test_logprob_token_ids.py",
    "chat_completion/test_enable_force_include_usage.py",
    "chat_completion/test_root_path.py",
    "chat_completion/test_batched_chat_completions.py",
    "completion/test_completion.py",
    "completion/test_prompt_validation.py::test_empty_prompt",
    "completion/test_prompt_validation.py::test_out_of_vocab_token_ids",
    "models/test_models.py",
    "test_chunked_prompt.py",
    "test_return_token_ids.py",
    "test_return_tokens_as_ids.py",
    "responses/test_basic.py",
    "responses/test_stateful.py",
    "responses/test_structured_output.py",
)

_UNIT = "unit tests of vLLM's own classes in-process; no server"
_THINKING = "a thinking model's reasoning (Qwen3 <think>); SmolLM2 does not think"
_HARMONY = "gpt-oss's Harmony format and its tool server"

#: The other files, each with why it is not run.
SKIPPED = {
    "chat_completion/test_chat_completion_with_prompt_embeds.py": "prompt embeddings input",
    "completion/test_completion_with_prompt_embeds.py": "prompt embeddings input",
    "chat_completion/test_chat_error.py": _UNIT,
    "chat_completion/test_completion_with_function_calling.py": "Qwen3 tool calls and "
    "reasoning, asserting the model calls the tool; a 135M model does not",
    "chat_completion/test_extra_content_fields.py": "multimodal (translategemma images)",
    "chat_completion/test_include_reasoning.py": _THINKING,
    "chat_completion/test_non_object_body_validation.py": _UNIT,
    "chat_completion/test_serving_chat.py": f"{_UNIT}; the server part is {_HARMONY}",
    "chat_completion/test_thinking_token_budget.py": _THINKING,
    "chat_completion/test_thinking_token_budget_validation.py": _UNIT,
    "completion/test_completion_error.py": _UNIT,
    "completion/test_completion_text_offset.py": _UNIT,
    "completion/test_lora_resolvers.py": f"{_UNIT} (vLLM's LoRA resolver plugins)",
    "completion/test_tensorizer_entrypoint.py": "vLLM's tensorizer weight format",
    "completion/test_token_in_token_out.py": "--skip-tokenizer-init with dummy weights "
    "from a local copy of Qwen3",
    "correctness/test_lmeval.py": "lm-eval accuracy thresholds of Qwen2-1.5B (GSM8K)",
    "parser/test_harmony_render_parity.py": _HARMONY,
    "parser/test_harmony_utils.py": _HARMONY,
    "responses/test_errors.py": _UNIT,
    "responses/test_function_call.py": "Qwen3 tool calls: asserts the model calls the tool",
    "responses/test_function_call_parsing.py": _UNIT,
    "responses/test_harmony.py": _HARMONY,
    "responses/test_harmony_utils.py": _HARMONY,
    "responses/test_mcp_tools.py": _HARMONY,
    "responses/test_namespace_tool_separator.py": "Qwen3 tool calls",
    "responses/test_parsable_context.py": f"{_THINKING}; Qwen3-8B tool calls",
    "responses/test_parsable_context_unit.py": _UNIT,
    "responses/test_protocol.py": _UNIT,
    "responses/test_response_input_to_harmony.py": _HARMONY,
    "responses/test_responses_utils.py": _UNIT,
    "responses/test_sampling_params.py": _UNIT,
    "responses/test_serving_responses.py": _UNIT,
    "responses/test_simple.py": _THINKING,
    "responses/test_streaming_events.py": _UNIT,
    "test_openai_schema.py": "schemathesis over a multimodal model's (SmolVLM) schema",
    "test_penalty_default_resolution.py": _UNIT,
    "test_reasoning_enable_thinking.py": _UNIT,
    "test_render_parity.py": _UNIT,
    "test_render_token_offsets.py": _UNIT,
    "test_session_id.py": _UNIT,
    "test_stop_token_ids.py": _UNIT,
    "test_tool_calls_serialization.py": _UNIT,
    "test_tool_choice_content_none.py": _UNIT,
    "test_watermarking.py": _UNIT,
}


def file_of(entry: str) -> str:
    """The file an entry names (`file.py::test` -> `file.py`)."""
    return entry.split("::", 1)[0]


def select(root: Path, requested: list[str] | None = None) -> list[str]:
    """pytest's arguments for the entries `requested` (the default set when None), as
    paths below `root`, the sdist's root; ValueError for an entry whose file is not there.
    """
    entries = list(requested) if requested else list(DEFAULT)
    missing = [e for e in entries if not (root / OPENAI_TESTS / file_of(e)).is_file()]
    if missing:
        raise ValueError(f"not in {root / OPENAI_TESTS}: {', '.join(missing)}")
    return [str(OPENAI_TESTS / entry) for entry in entries]


def unlisted(root: Path) -> list[str]:
    """The test files in the sdist that are neither run by default nor skipped with a
    reason (a newer vLLM's), so that a new file is seen and placed."""
    listed = {file_of(e) for e in DEFAULT} | set(SKIPPED)
    found = sorted(
        p.relative_to(root / OPENAI_TESTS) for p in (root / OPENAI_TESTS).rglob("test_*.py")
    )
    return [str(p) for p in found if str(p) not in listed]
