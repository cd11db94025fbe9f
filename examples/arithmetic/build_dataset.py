"""Write train.jsonl and test.jsonl for the arithmetic recipe, and spec.yaml to run the same job without the service.

    python build_dataset.py [--out DIR] [--model DIR]

Each row asks for a sum of two two-digit numbers, the number alone: {"messages": [user question], "answer": "71"}.
The rows come from a fixed seed (no download), distinct questions, the last TEST held out. The base model gets
few of them right and answers in a sentence; job.yaml's reward asks for the right number, briefly.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from recipe import write_recipe  # noqa: E402

TRAIN, TEST = 200, 20


def rows(seed: int = 7, train: int = TRAIN, test: int = TEST) -> tuple[list[dict], list[dict]]:
    """Two-digit sums, distinct questions, the last `test` held out; the same rows on every call."""
    rng, seen = random.Random(seed), set()
    while len(seen) < train + test:
        seen.add((rng.randint(10, 99), rng.randint(10, 99)))
    pairs = sorted(seen, key=lambda _: rng.random())
    every = [{"messages": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
              "answer": str(a + b)} for a, b in pairs]
    return every[:train], every[train:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--model", default="runs/SmolLM2-135M-Instruct", help="for spec.yaml (make real-model)")
    args = parser.parse_args()
    write_recipe(HERE, args.out, args.model, *rows())


if __name__ == "__main__":
    main()
