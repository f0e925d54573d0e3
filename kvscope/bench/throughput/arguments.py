"""The options of `bench throughput`, their defaults, and what is wrong with them.

Besides the common ones (`core/options.py`): the levels and the requests, which
systems run (`--peers`) and where their parts come from (`--vllm-python`,
`--llama-server`, `--peer-model`), how kvscope serve runs (`--worker`,
`--serve-dtype`), the workload (`--workload`) and speculation (`--speculative-config`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvscope.config import SpeculativeConfig
from kvscope.web.serve import SERVED_WORKER

from ..core.options import DTYPES, add_common_arguments

#: The dtypes kvscope serve runs a GGUF file in unless `--serve-dtype` says: as the
#: file holds its weights (llama.cpp's like), and dequantized to bfloat16 (vLLM's).
GGUF_SERVE_DTYPES = ("auto", "bfloat16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, threads="1,2")
    _add_workload_arguments(p)
    _add_kvscope_arguments(p)
    _add_peer_arguments(p)
    p.add_argument(
        "--level-timeout", type=float, default=600, help="seconds before a level is abandoned"
    )


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """What each system is sent: the levels, the prompts, the sampling."""
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument(
        "--min-requests",
        type=int,
        default=4,
        help="requests per level at least (a level sends max(this, concurrency))",
    )
    p.add_argument(
        "--workload",
        default="random",
        choices=WORKLOADS,
        help="random: distinct random-token prompts of --prompt-tokens; reuse: chats asking "
        "to repeat a code snippet of their own (exactly, or with its variables renamed), "
        "rendered with the model's chat template, each snippet at least --max-tokens "
        "tokens (--prompt-tokens does not apply; core/reuse_workload.py)",
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=256, help="prompt length (the random workload)"
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every system's requests sample at this temperature (default 0: greedy)",
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="and keep this top-p nucleus (default 1: all)"
    )
    p.add_argument(
        "--hf-requests", type=int, default=4, help="requests for transformers one at a time"
    )


def _add_kvscope_arguments(p: argparse.ArgumentParser) -> None:
    """How kvscope serve runs: the worker, the paired rounds, the dtypes."""
    p.add_argument(
        "--worker",
        default=SERVED_WORKER,
        help="where kvscope serve runs the model: thread, process (comma-separated, each "
        "measured; the first is the one the headline compares with vLLM)",
    )
    p.add_argument(
        "--paired-rounds",
        type=int,
        default=3,
        help="rounds of kvscope serve (the first --worker) and the engine in-process "
        "taking turns at each level, for the serving path's cost (0 skips)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        help="speculative decoding, vLLM's JSON as is (docs/speculative.md): given to every "
        "kvscope run and to vLLM; kvscope serve is also measured without it, its row "
        "labelled 'no speculation' (greedy and sampled requests speculate alike)",
    )
    p.add_argument(
        "--serve-dtype",
        default=None,
        help="dtypes kvscope serve runs in, comma-separated, each measured (default: "
        "--dtype; for a GGUF file auto,bfloat16: its weights as the file holds them, "
        "and dequantized)",
    )


def _add_peer_arguments(p: argparse.ArgumentParser) -> None:
    """Which peers run beside kvscope, and where they are found."""
    p.add_argument(
        "--peer-model",
        type=Path,
        default=None,
        help="for a GGUF --model: the Hugging Face directory of the same weights that vLLM "
        "and transformers serve (write it with `kvscope bench convert FILE.gguf DIR`)",
    )
    p.add_argument(
        "--peers",
        default="kvscope-serve,vllm,llama.cpp,transformers",
        help="peers to run: kvscope-serve,vllm,llama.cpp,transformers (or none)",
    )
    p.add_argument(
        "--llama-server",
        default=None,
        help="llama.cpp's llama-server binary, for the llama.cpp peer on a GGUF --model "
        "(default: $KVSCOPE_LLAMA_SERVER)",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of the venv vLLM's CPU build is installed in "
        "(default: $KVSCOPE_VLLM_PYTHON or /root/vllm-venv/bin/python)",
    )


def serve_dtypes(args: argparse.Namespace, gguf: bool) -> list[str]:
    """The dtypes kvscope serve runs in: `--serve-dtype`, else see `GGUF_SERVE_DTYPES`."""
    if args.serve_dtype:
        return [d.strip() for d in args.serve_dtype.split(",") if d.strip()]
    return list(GGUF_SERVE_DTYPES) if gguf else [args.dtype]


#: What `--workload` may name (`core/workload.py`, `core/reuse_workload.py`).
WORKLOADS = ("random", "reuse")

#: The systems `--peers` may name.
PEERS = ("kvscope-serve", "vllm", "llama.cpp", "transformers")


def peers_of(args: argparse.Namespace) -> set[str]:
    return {p.strip() for p in args.peers.split(",")} - {"", "none"}


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, or None."""
    if unknown := sorted(peers_of(args) - set(PEERS)):
        return f"--peers: unknown {', '.join(unknown)}; known: {', '.join(PEERS)} (or none)"
    if args.peer_model is not None and not (args.peer_model / "config.json").is_file():
        return f"--peer-model {args.peer_model}: no config.json there (a Hugging Face directory)"
    if args.speculative_config is not None:
        try:
            SpeculativeConfig.parse(args.speculative_config)
        except ValueError as exc:
            return f"--speculative-config: {exc}"
    if args.serve_dtype and (bad := set(args.serve_dtype.split(",")) - set(DTYPES)):
        return f"--serve-dtype: unknown {', '.join(sorted(bad))}; known: {', '.join(DTYPES)}"
    return None
