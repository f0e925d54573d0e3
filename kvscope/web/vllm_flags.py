"""vLLM's `serve` flags in `kvscope serve`: the ones kvscope honours, spelled as vLLM
spells them, the ones accepted because kvscope always does what they ask, and what
kvscope refuses of them (said as an error), so that a `vllm serve` command line runs as
it is or says why not.
"""

from __future__ import annotations

import argparse
import json

from .asgi.cors import CorsPolicy

#: vLLM's flags that ask for what kvscope always does (or, for remote code, never
#: needs): accepted, so that a `vllm serve` command line runs as it is.
ALWAYS = {
    "--enable-auto-tool-choice": "tool_choice auto always reads calls (--tool-call-parser)",
    "--trust-remote-code": "kvscope runs its own model classes, never a checkpoint's code",
    "--enforce-eager": "the forward always runs eagerly",
    "--enable-chunked-prefill": "long prompts are always computed in chunks beside decodes",
    "--enable-lora": "the adapters --lora-modules names are served",
}


#: vLLM's switches of the OpenAI surface that kvscope honours (`ServerSettings` holds
#: each), and what each does.
SWITCHES = {
    "--enable-prompt-tokens-details": "usage counts the prompt tokens the prefix cache held "
    "(prompt_tokens_details.cached_tokens)",
    "--enable-force-include-usage": "every stream sends usage, on each chunk and in a last "
    "usage chunk",
    "--return-tokens-as-token-ids": "log-probabilities show each token as token_id:N (a "
    "request's return_tokens_as_token_ids decides for it)",
}


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's `serve` options that kvscope honours, spelled as vLLM spells them."""
    group = parser.add_argument_group("as vllm serve takes them")
    cors = CorsPolicy()  # the defaults, stated on the policy
    group.add_argument(
        "--allowed-origins",
        nargs="+",
        default=list(cors.origins),
        metavar="ORIGIN",
        help="browser origins that may call (CORS): origins, or a JSON list; * for any "
        "(default: none, where vLLM allows any; docs/security.md)",
    )
    group.add_argument(
        "--allowed-methods",
        nargs="+",
        default=list(cors.methods),
        metavar="METHOD",
        help=f"(CORS) default {' '.join(cors.methods)}",
    )
    group.add_argument(
        "--allowed-headers",
        nargs="+",
        default=list(cors.headers),
        metavar="HEADER",
        help=f"(CORS) default {' '.join(cors.headers)}",
    )
    group.add_argument(
        "--allow-credentials", action="store_true", help="(CORS) with cookies and HTTP auth"
    )
    group.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats line (throughput, running, waiting, KV cache, prefix hits)",
    )
    group.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        help="no log line for each request's start and end",
    )
    group.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_true",
        help="a log line for each request's start and end (kvscope's default)",
    )
    parser.set_defaults(log_requests=True)
    for flag, what in SWITCHES.items():
        group.add_argument(flag, action="store_true", help=what)
    for flag, why in ALWAYS.items():
        group.add_argument(flag, action="store_true", help=f"accepted: {why}")
    for flag, short in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        group.add_argument(flag, short, type=int, default=1, help="1: one device serves a model")
    for flag in ("--max-loras", "--max-cpu-loras"):
        group.add_argument(
            flag,
            type=int,
            default=None,
            help="accepted: every adapter of --lora-modules stays loaded, and any number "
            "share a step",
        )


def vllm_refusals(args: argparse.Namespace) -> str | None:
    """What of vLLM's options kvscope cannot do, said as an error; None if all can be."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, name) != 1:
            flag = "--" + name.replace("_", "-")
            return (
                f"{flag} {getattr(args, name)}: kvscope runs a model on one device; for more "
                "throughput, serve replicas (--replicas N, on Ray Serve)"
            )
    return None


def names(values: list[str]) -> tuple[str, ...]:
    """Names given one by one, comma-separated, or as a JSON list (vLLM's spelling)."""
    names: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            listed = json.loads(value)
            if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
                raise ValueError(f"not a JSON list of strings: {value}")
            names += listed
        else:
            names += [name.strip() for name in value.split(",") if name.strip()]
    return tuple(names)
