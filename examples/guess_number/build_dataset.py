"""Build the rows of the guessing-game example job: the rules as the prompt, and each episode's range and secret.

    python build_dataset.py                  # 2000 training rows and 100 held-out rows (seeded; no download)
    python build_dataset.py --rows 8 --out /tmp/x   # a tiny sample

Each row is {"prompt": [system, user], "low": 1, "high": 50, "secret": 37}; the environment (environment.py)
reads low, high and secret, and the model sees only the prompt and the environment's hints.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = "You are playing a number guessing game. Reply with your guess as a single whole number."


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        high = rng.choice([10, 20, 50, 100])
        rows.append({"prompt": [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": f"I am thinking of a whole number from 1 to {high}. "
                                                            "What is your guess?"}],
                     "low": 1, "high": high, "secret": rng.randint(1, high)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2000, help="training rows (a twentieth more are held out)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent, help="where to write the rows")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", make_rows(args.rows, args.seed)),
                       ("test.jsonl", make_rows(max(args.rows // 20, 1), args.seed + 1))):
        (args.out / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"wrote {len(rows)} rows to {args.out / name}")


if __name__ == "__main__":
    main()
