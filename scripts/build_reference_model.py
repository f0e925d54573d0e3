"""Build the benchmarks' reference Llama (about 32 M parameters, bfloat16, seeded random
weights, a byte-level BPE tokenizer trained offline) into a directory.

    python scripts/build_reference_model.py [DIR] [--seed N]

DIR defaults to ~/.cache/kvscope/reference-llama (or $KVSCOPE_REFERENCE_MODEL). The
benchmarks build it there themselves on first use; this script is for building it
ahead of time or elsewhere (for example, for vLLM to load).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from kvscope.bench.core.reference_model import DEFAULT_DIR, build_reference_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build_reference_model(args.directory, seed=args.seed))


if __name__ == "__main__":
    main()
