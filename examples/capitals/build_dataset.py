"""Write train.jsonl and test.jsonl for the capitals recipe, and spec.yaml to run the same job without the service.

    python build_dataset.py [--out DIR] [--model DIR]

Each row asks for a country's capital in one word: {"messages": [user question], "answer": "Paris"}. The rows are
built here from the list below (no download); the last TEST countries are held out. The base model knows many of
the capitals but answers in a sentence; job.yaml's reward asks for the name alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from recipe import write_recipe  # noqa: E402

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Peru", "Lima"), ("Russia", "Moscow"), ("China", "Beijing"),
    ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Poland", "Warsaw"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
    ("Ireland", "Dublin"), ("Hungary", "Budapest"), ("Cuba", "Havana"), ("Kenya", "Nairobi"),
    ("Thailand", "Bangkok"), ("Argentina", "Buenos Aires"), ("Chile", "Santiago"), ("Belgium", "Brussels"),
    ("Netherlands", "Amsterdam"), ("Turkey", "Ankara"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
    ("India", "New Delhi"), ("Mexico", "Mexico City"), ("South Korea", "Seoul"), ("Vietnam", "Hanoi"),
    ("Indonesia", "Jakarta"), ("Philippines", "Manila"), ("Colombia", "Bogota"), ("Venezuela", "Caracas"),
    ("Ukraine", "Kyiv"), ("Romania", "Bucharest"),
    # held out
    ("Australia", "Canberra"), ("Brazil", "Brasilia"), ("Switzerland", "Bern"), ("Czech Republic", "Prague"),
    ("Morocco", "Rabat"), ("Nigeria", "Abuja"), ("Pakistan", "Islamabad"), ("Saudi Arabia", "Riyadh"),
    ("Ethiopia", "Addis Ababa"), ("New Zealand", "Wellington"), ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"),
    ("Croatia", "Zagreb"), ("Iceland", "Reykjavik"), ("Lebanon", "Beirut"), ("Syria", "Damascus"),
    ("Afghanistan", "Kabul"), ("Nepal", "Kathmandu"), ("Ghana", "Accra"), ("Jamaica", "Kingston"),
]
TEST = 20


def question(country: str) -> str:
    return f"What is the capital of {country}? Answer with the city's name only."


def rows(pairs) -> list[dict]:
    return [{"messages": [{"role": "user", "content": question(c)}], "answer": a} for c, a in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--model", default="runs/SmolLM2-135M-Instruct", help="for spec.yaml (make real-model)")
    args = parser.parse_args()
    write_recipe(HERE, args.out, args.model, rows(CAPITALS[:-TEST]), rows(CAPITALS[-TEST:]))


if __name__ == "__main__":
    main()
