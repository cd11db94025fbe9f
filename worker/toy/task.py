"""The 'last letter' toy task: dataset rows and their verifiable reward."""

from __future__ import annotations

import json
import random
from pathlib import Path

LETTERS = "abcdef"


def make_rows(n: int, *, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 5)))
        rows.append({"prompt": f"{word}=", "answer": word[-1]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reward(completion: str, answer: str, **_row) -> float:
    """1 for exactly the answer letter, 0 otherwise."""
    return 1.0 if completion.strip() == answer else 0.0
