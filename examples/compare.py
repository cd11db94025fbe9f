"""Greedy answers on a recipe's held-out rows before and after: the base model, then the base with the job's adapter.

    python examples/compare.py MODEL_DIR RUN_DIR --test examples/arithmetic/test.jsonl [--samples 5]
    # RUN_DIR: what `cispo train spec.yaml` wrote (spec/ beside spec.yaml)

Prints, for each, how many replies are right (a numeric answer: the reply's last number equals it; a text answer:
the reply contains it, case ignored) and how many are the answer alone (exact match: case and punctuation
ignored), then a few rows side by side.
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.rewards.builtins import last_number


def normalized(text: str) -> str:
    return text.translate(str.maketrans("", "", string.punctuation)).strip().casefold()


def right(reply: str, answer: str) -> bool:
    try:
        return last_number(reply) == float(answer)
    except ValueError:  # a text answer
        return answer.casefold() in reply.casefold()


def greedy(model, tok, rows: list[dict], max_new: int) -> list[str]:
    out = []
    for row in rows:
        ids = tok.apply_chat_template(row["messages"], add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)
        with torch.no_grad():
            new = model.generate(**ids, max_new_tokens=max_new, do_sample=False)[0, ids["input_ids"].shape[1]:]
        out.append(tok.decode(new, skip_special_tokens=True))
    return out


def final_adapter(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "adapter"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--test", type=Path, required=True, help="the recipe's test.jsonl")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--max-new", type=int, default=12)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.test.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    before = greedy(base, tok, rows, args.max_new)
    adapter = final_adapter(args.run_dir)
    after = greedy(PeftModel.from_pretrained(base, adapter).eval(), tok, rows, args.max_new)
    for name, answers in (("before", before), ("after", after)):
        hits = sum(right(a, r["answer"]) for a, r in zip(answers, rows))
        exact = sum(normalized(a) == normalized(r["answer"]) for a, r in zip(answers, rows))
        print(f"{name}: {hits}/{len(rows)} right, {exact}/{len(rows)} the answer alone, on the held-out rows")
    print(f"adapter: {adapter}")
    for row, b, a in list(zip(rows, before, after))[:args.samples]:
        print(f"  {row['messages'][0]['content']!r} (answer {row['answer']!r}): before {b!r} -> after {a!r}")


if __name__ == "__main__":
    main()
