"""Build the GSM8K rows of the example job: chat prompts, and the number after '####' as the answer.

    python build_dataset.py                   # openai/gsm8k from the Hugging Face hub (needs `pip install datasets`)
    python build_dataset.py --from-jsonl DIR  # DIR/train.jsonl and DIR/test.jsonl in GSM8K's own format
                                              # ({"question", "answer"}), e.g. github.com/openai/grade-school-math
    python build_dataset.py --sample          # four hand-written problems, offline (what the tests use)

Writes train.jsonl and test.jsonl (to --out, default: next to this script). Each row is
{"prompt": [{"role": "user", "content": question + INSTRUCTION}], "answer": "72"}: the prompt asks for the
final answer after '####', as verl's GSM8K preprocessing does, and the job's reward (numeric_match with
source after_hashes) reads the number after the last '####' of the completion.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
ANSWER = re.compile(r"####\s*(-?[0-9][0-9.,]*)")

SAMPLE = [  # GSM8K-style, written for this example
    ("Tom has 3 boxes with 12 pencils each. He gives away 7 pencils. How many pencils does he have left?",
     "3 boxes hold 3 * 12 = 36 pencils. After giving 7 away he has 36 - 7 = 29.\n#### 29"),
    ("A bakery sells muffins for $2 each. On Monday it sold 45 muffins and on Tuesday twice as many. "
     "How much money did it make on the two days?",
     "Tuesday: 2 * 45 = 90 muffins. Together 45 + 90 = 135 muffins, so 135 * 2 = 270 dollars.\n#### 270"),
    ("Lena reads 15 pages a day. Her book has 180 pages. How many days does she need to finish it?",
     "180 / 15 = 12 days.\n#### 12"),
    ("A train travels 60 km per hour for 2.5 hours. How many kilometers does it travel?",
     "60 * 2.5 = 150 km.\n#### 150"),
]


def to_row(question: str, solution: str) -> dict:
    """One of our rows from a GSM8K question and its worked solution (which ends with '#### N')."""
    found = ANSWER.findall(solution)
    if not found:
        raise ValueError(f"no '#### N' answer in the solution: {solution[-80:]!r}")
    return {"prompt": [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}],
            "answer": found[-1].replace(",", "").rstrip(".")}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {len(rows)} rows to {path}")


def splits(args) -> dict[str, list[tuple[str, str]]]:
    if args.sample:
        return {"train": SAMPLE, "test": SAMPLE[:2]}
    if args.from_jsonl:
        out = {}
        for split in ("train", "test"):
            lines = (Path(args.from_jsonl) / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
            out[split] = [(r["question"], r["answer"]) for r in map(json.loads, filter(str.strip, lines))]
        return out
    from datasets import load_dataset  # only this path downloads

    data = load_dataset("openai/gsm8k", "main")
    return {split: list(zip(data[split]["question"], data[split]["answer"])) for split in ("train", "test")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--sample", action="store_true", help="write the built-in sample (offline)")
    source.add_argument("--from-jsonl", metavar="DIR", help="read GSM8K's train.jsonl and test.jsonl from DIR")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent, help="where to write the rows")
    args = parser.parse_args()
    for split, pairs in splits(args).items():
        write_jsonl(args.out / f"{split}.jsonl", [to_row(q, a) for q, a in pairs])


if __name__ == "__main__":
    main()
