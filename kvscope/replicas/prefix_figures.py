"""`python -m kvscope.replicas.prefix_figures`: the prefix-cache hit rate of 2 replicas
with and without prefix-aware routing (see `prefix`).

For each pool size and each routing mode it starts `kvscope serve --replicas 2`
(bundled model, `--[no-]prefix-routing`) and sends a workload of shared-prefix
prompts: `prefixes` documents of about 400 characters (a head of ~8 KV blocks), each
asked `questions` different short questions, in rounds (every document once per
round, so a cache that cannot hold every document evicts them before they return),
`concurrency` calls at a time (`/v1/completions`, 2 tokens each). The hit rate is
each replica's `prompt_tokens_reused / prompt_tokens_admitted` from `/stats?replica=`
(prompt tokens found computed in its prefix cache, over the prompt tokens it
admitted); the routed share says how evenly the calls spread. It writes
`docs/benchmarks/prefix-routing-<date>.json` and prints a table. Figures from a
shared, loaded machine vary run to run; the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from .figures import ROOT, free_port, revision, serving, wait_ready

WORDS = (
    "river stone lantern orchard winter copper harbor meadow signal ledger canvas "
    "thread pillar garden compass archive beacon valley timber market quarry"
).split()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", type=int, default=12)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--pools", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--out", default=None)
    parser.add_argument("--work", default="/tmp/kvscope-prefix-routing")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prompts = workload(args.prefixes, args.questions)
    result: dict[str, Any] = {
        "load_before": os.getloadavg(),
        "workload": {
            "prefixes": args.prefixes,
            "questions": args.questions,
            "calls": len(prompts),
            "concurrency": args.concurrency,
            "prefix_chars": len(prompts[0]) - len(prompts[0].split("\n")[-1]),
        },
        "runs": {},
    }
    for pool in args.pools:
        for routing in (False, True):
            name = f"pool-{pool}-{'prefix' if routing else 'default'}-routing"
            result["runs"][name] = measure(name, pool, routing, prompts, args.concurrency, work)
            print(name, json.dumps(result["runs"][name]["total"]), flush=True)
    result["load_after"] = os.getloadavg()
    result["revision"] = revision()
    out = (
        args.out
        or ROOT / "docs" / "benchmarks" / f"prefix-routing-{time.strftime('%Y-%m-%d')}.json"
    )
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


def workload(prefixes: int, questions: int) -> list[str]:
    """Round after round, every document once with its next question."""
    documents = []
    for k in range(prefixes):
        rng = random.Random(k)
        words = " ".join(rng.choice(WORDS) for _ in range(60))
        documents.append(f"Document {k}. {words}.")
    return [
        f"{documents[k]}\nQuestion {q}: what is word {q + 1} of document {k}?"
        for q in range(questions)
        for k in range(prefixes)
    ]


def measure(
    name: str, pool: int, routing: bool, prompts: list[str], concurrency: int, work: Path
) -> dict[str, Any]:
    port = free_port()
    command = [sys.executable, "-m", "kvscope.cli", "serve", "--port", str(port)]
    command += ["--replicas", "2", "--ray-cpus", "4", "--num-kv-blocks", str(pool)]
    command += ["--model-threads", "1", "--log-level", "WARNING"]
    command += ["--prefix-routing" if routing else "--no-prefix-routing"]
    with serving(command, work / f"{name}.log") as process:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            wait_ready(client, process, replicas=2)
            before = client.get("/stats").json()["replicas"]
            started = time.perf_counter()

            def call(prompt: str) -> str:
                body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
                answer = client.post("/v1/completions", json=body)
                answer.raise_for_status()
                return answer.headers["x-kvscope-replica"]

            with ThreadPoolExecutor(concurrency) as pool_:
                answered = list(pool_.map(call, prompts))
            took = time.perf_counter() - started
            after = client.get("/stats").json()["replicas"]
    per_replica = {
        replica: _rates(before.get(replica, {}), stats, answered.count(replica))
        for replica, stats in after.items()
    }
    total = _rates(
        {k: sum(s.get(k, 0) for s in before.values()) for k in _KEYS},
        {k: sum(s[k] for s in after.values()) for k in _KEYS},
        len(answered),
    )
    return {"seconds": took, "total": total, "replicas": per_replica}


_KEYS = ("prompt_tokens_admitted", "prompt_tokens_reused")


def _rates(before: dict[str, Any], after: dict[str, Any], calls: int) -> dict[str, Any]:
    admitted = after["prompt_tokens_admitted"] - before.get("prompt_tokens_admitted", 0)
    reused = after["prompt_tokens_reused"] - before.get("prompt_tokens_reused", 0)
    return {
        "calls": calls,
        "prompt_tokens_admitted": admitted,
        "prompt_tokens_reused": reused,
        "hit_rate": reused / admitted if admitted else 0.0,
    }


def table(result: dict[str, Any]) -> str:
    rows = ["| run | calls per replica | hit rate per replica | hit rate | seconds |"]
    rows.append("| --- | --- | --- | --- | --- |")
    for name, run in result["runs"].items():
        replicas = run["replicas"].values()
        calls = " / ".join(str(r["calls"]) for r in replicas)
        rates = " / ".join(f"{r['hit_rate']:.0%}" for r in replicas)
        rows.append(
            f"| {name} | {calls} | {rates} | {run['total']['hit_rate']:.0%} "
            f"| {run['seconds']:.1f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
