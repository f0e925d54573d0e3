"""One server for `kvscope serve` (whose flags and choice of one server or replicas
are `kvscope.serve`'s): the server's flags, the `ServerSettings` they make, and
`Server` run until it is stopped.

With no flags it serves the bundled model on 127.0.0.1:8000 on asyncio. Keys come
from `--api-key` (repeatable), `KVSCOPE_API_KEY` or vLLM's `VLLM_API_KEY`
(comma-separated) and a key file (`--api-key-file` or `KVSCOPE_API_KEY_FILE`; keys
there stay out of `ps`). Once it
listens it prints where and what it runs, the dashboard's URL and a `curl` line that
streams a completion (a newcomer's next step); it exits 0 after a graceful
SIGINT/SIGTERM shutdown.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import typing
from pathlib import Path
from typing import Any

import anyio
import attrs

from kvscope.config import EngineConfig
from kvscope.options import field_help, value_type

from .asgi.cors import CorsPolicy
from .openai import lora_admin
from .parsers.reasoning import PARSERS as REASONING_PARSERS
from .parsers.tool_calls import PARSERS
from .server import Server
from .settings import STATS_LOG_INTERVAL, ServerSettings
from .vllm_flags import names

log = logging.getLogger("kvscope.web")

#: The prompt of the printed `curl` line: code, which the bundled model does best.
EXAMPLE_PROMPT = "def fibonacci(n):"
#: What the printed curl line asks a model that has a chat template.
EXAMPLE_QUESTION = "What is the capital of France? Answer in one sentence."

#: Where one server runs the forward unless `--worker` says: a model worker process,
#: so the event loop never shares a GIL with the forward (32 streams, reference model,
#: served: 266-269 tok/s in every run, where a thread gave 220-230 in three runs and
#: 270 in one; docs/benchmarks/README.md, "Measured settings": a model worker process
#: by default). (`Engine.open`'s default stays
#: "thread", for embedding; a replica's: `kvscope.serve`.)
SERVED_WORKER = "process"
#: The cores a served model worker process keeps to (`scheduling.model_cores`).
SERVED_WORKER_CORES = attrs.fields(EngineConfig).worker_cores.default


def add_setting(group: Any, name: str, help: str | None = None, **options: Any) -> None:
    """The flag of the `ServerSettings` field `name` (`loop_priority` ->
    `--loop-priority`): the field's default and type, and its `#:` comment as the help
    unless `help` says otherwise, as `kvscope.options` derives the engine's from
    `EngineConfig`; so a setting's default is written once, on the settings class."""
    field = getattr(attrs.fields(ServerSettings), name)
    kind = value_type(typing.get_type_hints(ServerSettings)[name])
    text = field_help(ServerSettings).get(name, "") if help is None else help
    group.add_argument(
        "--" + name.replace("_", "-"),
        type=kind,
        default=field.default,
        help=f"{text} (default: %(default)s)".lstrip(),
        **options,
    )


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that make `ServerSettings` (with vLLM's: `vllm_flags`)."""
    group = parser.add_argument_group("server")
    add_setting(group, "host")
    add_setting(group, "port", "0 picks a free port")
    group.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a bearer key (repeatable); visible in `ps`: prefer --api-key-file or KVSCOPE_API_KEY",
    )
    group.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="a file of bearer keys, one per line (# starts a comment); also KVSCOPE_API_KEY_FILE",
    )
    add_setting(group, "drain_timeout", "seconds live requests may finish on shutdown")
    add_setting(group, "max_body_bytes", "largest request body (413 past it)")
    add_setting(group, "root_path")
    add_setting(
        group,
        "tool_call_parser",
        "how tool_choice auto reads calls: the format the chat template shows, "
        "unless set (vLLM's parsers of these names)",
        choices=PARSERS,
    )
    add_setting(
        group,
        "reasoning_parser",
        "tell a thinking model's <think> reasoning from its answer (reasoning_content), "
        "as vLLM's parsers of these names",
        choices=REASONING_PARSERS,
    )
    add_setting(
        group,
        "loop_priority",
        "the event loop thread's real-time (SCHED_FIFO) priority, 1-99, where the OS "
        "allows it (CAP_SYS_NICE or RLIMIT_RTPRIO); 0: none",
    )


#: The environment variables that hold keys (comma-separated): kvscope's, and vLLM's.
KEY_VARIABLES = ("KVSCOPE_API_KEY", "VLLM_API_KEY")


def settings_from(args: argparse.Namespace) -> ServerSettings:
    keys = list(args.api_key)
    for variable in KEY_VARIABLES:
        keys += [k for k in os.environ.get(variable, "").split(",") if k.strip()]
    key_file = args.api_key_file or os.environ.get("KVSCOPE_API_KEY_FILE")
    if key_file:
        keys += read_key_file(key_file)
    return ServerSettings(
        host=args.host,
        port=args.port,
        backend=args.backend,
        api_keys=keys,
        max_body_bytes=args.max_body_bytes,
        drain_timeout=args.drain_timeout,
        loop_priority=args.loop_priority,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        cors=CorsPolicy(
            names(args.allowed_origins),
            tuple(m.upper() for m in names(args.allowed_methods)),
            names(args.allowed_headers),
            args.allow_credentials,
        ),
        stats_log_interval=0.0 if args.disable_log_stats else STATS_LOG_INTERVAL,
        runtime_lora_updating=os.environ.get(lora_admin.SWITCH, "").lower() in lora_admin.SWITCH_ON,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        force_include_usage=args.enable_force_include_usage,
        model_path=args.model,
        root_path=args.root_path,
    )


def read_key_file(path: str) -> list[str]:
    """The keys in a key file: one a line, blank lines and `#` comments skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the API key file {path}: {exc.strerror}") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [key for key in keys if key and not key.startswith("#")]
    if not keys:
        raise ValueError(f"the API key file {path} holds no key")
    return keys


def serve_one(model: str, settings: ServerSettings, engine_kwargs: dict[str, Any]) -> int:
    """Run one server until SIGINT/SIGTERM; print where it listens once it does. The
    exit status: 0 after a graceful stop, 1 if it cannot listen, 2 for bad settings."""
    server = Server(settings, engine_kwargs, handle_signals=True)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(server.run)
            engine = server.engine
            device = engine.device if engine else "?"
            generates = engine.loaded.generates if engine else True
            chats = bool(engine and engine.loaded.chat_template)
            print(
                f"kvscope serving {model} on {server.url} "
                f"(device {device}, backend {settings.backend})",
                *first_steps(
                    server.url,
                    with_key=bool(settings.api_keys),
                    generates=generates,
                    chats=chats,
                ),
                sep="\n",
                flush=True,
            )

    try:
        try:
            anyio.run(main, backend=settings.backend)
        except BaseExceptionGroup as group:
            raise _first(group) from None
    except OSError as exc:
        print(f"error: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # ModelLoadError and bad engine settings
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        _stop_resource_tracker()
    return 0


def _stop_resource_tracker() -> None:
    """Stop and reap multiprocessing's resource tracker (started with the model worker
    process). Left to exit after this process, it would be an orphan, which a PID 1 that
    reaps nothing (a container's) keeps as a zombie. It tracks nothing of ours: the
    model worker uses no named semaphore or shared_memory segment."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)  # since Python 3.8
    if stop is not None:
        stop()


def first_steps(
    url: str, *, with_key: bool, generates: bool = True, chats: bool = False
) -> list[str]:
    """The lines after the listening line: the dashboard, and a chat question (a
    completion for a model without a chat template, an embedding for a model that
    only embeds) to stream, both at an address this machine's browser and curl can
    open. With keys, the curl line reads one from the variable that holds them
    (`KVSCOPE_API_KEY` unless only `VLLM_API_KEY` is set)."""
    url = _local_url(url)
    if generates and chats:
        message = {"role": "user", "content": EXAMPLE_QUESTION}
        body = json.dumps({"messages": [message], "max_tokens": 64, "stream": True})
        curl = f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json'"
    elif generates:
        body = json.dumps({"prompt": EXAMPLE_PROMPT, "max_tokens": 64, "stream": True})
        curl = f"curl -N {url}/v1/completions -H 'Content-Type: application/json'"
    else:
        body = json.dumps({"input": EXAMPLE_PROMPT})
        curl = f"curl {url}/v1/embeddings -H 'Content-Type: application/json'"
    if with_key:  # the key itself is not printed: the shell fills it in
        variable = next((v for v in KEY_VARIABLES if os.environ.get(v)), KEY_VARIABLES[0])
        curl += f' -H "Authorization: Bearer ${variable}"'
    return [f"  dashboard: {url}/", f"  try:       {curl} -d {shlex.quote(body)}"]


def _local_url(url: str) -> str:
    """`url` with a wildcard host (every interface) replaced by loopback, which a
    browser and curl on this machine can open."""
    for wildcard, loopback in (("//0.0.0.0:", "//127.0.0.1:"), ("//[::]:", "//[::1]:")):
        url = url.replace(wildcard, loopback)
    return url


def _first(group: BaseExceptionGroup) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
