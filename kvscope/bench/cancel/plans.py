"""What each stream of a `bench cancel` run does: `Plan`s, the same choices in every run.

Which positions are cancelled, which of those by closing the stream, and after how
many tokens and how much jitter, all come from `--seed`; only the prompts differ from
run to run (`prompt_seed`), so the prefix cache cannot help and the survivors are the
same positions in the run with cancels and in the baseline.
"""

from __future__ import annotations

import argparse
import random

from ..core.workload import make_prompts
from .client import Plan


def make_plans(args: argparse.Namespace, vocab: int, prompt_seed: int, cancels: bool) -> list[Plan]:
    prompts = make_prompts(args.requests, args.prompt_tokens, vocab, seed=prompt_seed)
    rng = random.Random(args.seed)  # the same choices in both runs
    n_cancel = round(args.requests * args.cancel_fraction)
    chosen = sorted(rng.sample(range(args.requests), n_cancel))
    n_disconnect = round(n_cancel * args.disconnect_fraction)
    disconnect = set(rng.sample(chosen, n_disconnect))
    low, high = (int(x) for x in args.cancel_after.split(","))
    plans = []
    for i, prompt in enumerate(prompts):
        after, jitter = rng.randint(low, high), rng.uniform(0, args.jitter_ms / 1e3)
        action = "keep" if i not in chosen else "disconnect" if i in disconnect else "delete"
        plans.append(Plan(i, prompt, action if cancels else "keep", after, jitter))
    return plans
