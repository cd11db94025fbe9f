"""Rows/s of a simple Python reward: in-process vs through the sandbox (one child, and a pool of children).

Also the regex reward: Python's re in-process (what it was) vs the killable
child with deadlines that it runs in now (worker/rewards/regex.py), and the
json_schema reward likewise (jsonschema in-process vs in that child, where a
schema's user patterns run now).

    .venv/bin/python bench/reward_throughput.py            # a few seconds
    .venv/bin/python bench/reward_throughput.py --rows 100000

Every figure comes from the same run, on the same rows. Sandbox start-up
(namespaces, new root, interpreter, loading the source) is timed apart, and
each sandboxed mode scores one warm-up batch before the clock starts.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema  # noqa: E402

from service.schemas.reward_checks import JsonSchemaReward  # noqa: E402
from service.schemas.rewards import RegexReward  # noqa: E402
from worker.rewards.json_checks import JsonSchemaBatchScorer  # noqa: E402
from worker.rewards.regex import RegexBatchScorer  # noqa: E402
from worker.rewards.sandbox import PythonRewardPool, PythonRewardProcess  # noqa: E402
from service.sandbox.spawn import sandbox_level  # noqa: E402

SOURCE = """
SPIN = {spin}
def reward(completion, answer, **row):
    for _ in range(SPIN):  # --spin: stands for a costlier reward (a parser, a checker)
        pass
    words = completion.strip().split()
    return 1.0 if words and words[-1] == str(answer) else 0.0
"""


def make_rows(n: int) -> tuple[list[str], list[dict]]:
    completions = [f"The answer to question {i} is {i % 97}" for i in range(n)]
    rows = [{"prompt": f"question {i}", "answer": (i % 97) if i % 3 else -1} for i in range(n)]
    return completions, rows


def direct(source, completions, rows) -> float:
    namespace: dict = {}
    exec(compile(source, "<reward>", "exec"), namespace)
    fn = namespace["reward"]
    started = time.perf_counter()
    total = sum(float(fn(c, **r)) for c, r in zip(completions, rows))
    elapsed = time.perf_counter() - started
    assert total > 0
    return len(rows) / elapsed


def sandboxed(scorer, completions, rows, batch: int) -> float:
    scorer.score(completions[:batch], rows[:batch])  # warm-up: the child is running and loaded
    started = time.perf_counter()
    for i in range(0, len(rows), batch):
        result = scorer.score(completions[i:i + batch], rows[i:i + batch])
        assert all(e is None for e in result.errors), result.errors[:3]
    return len(rows) / (time.perf_counter() - started)


def regex_rates(completions, batch: int) -> tuple[float, float]:
    """(in-process rows/s, child rows/s) for one anchored pattern over the same completions."""
    spec = RegexReward(pattern=r"is (\d+)$")
    pattern = re.compile(spec.pattern)
    started = time.perf_counter()
    hits = sum(1 for c in completions if pattern.search(c))
    direct_rate = len(completions) / (time.perf_counter() - started)
    scorer = RegexBatchScorer(spec)
    try:
        scorer.score(completions[:batch], [{}] * batch)  # warm-up: the child is running
        started = time.perf_counter()
        matched = 0.0
        for i in range(0, len(completions), batch):
            chunk = completions[i:i + batch]
            out = scorer.score(chunk, [{}] * len(chunk))
            assert all(e is None for e in out.errors), out.errors[:3]
            matched += sum(out.scores)
        child_rate = len(completions) / (time.perf_counter() - started)
    finally:
        scorer.close()
    assert matched == hits
    return direct_rate, child_rate


SCHEMA = {"type": "object", "required": ["answer"], "additionalProperties": False,
          "properties": {"answer": {"type": "string", "pattern": r"^\d+$"}, "why": {"type": "string", "maxLength": 200}}}


def schema_rates(n: int, batch: int) -> tuple[float, float]:
    """(in-process rows/s, child rows/s) validating the same JSON completions against SCHEMA."""
    completions = [json.dumps({"answer": str(i) if i % 3 else f"x{i}", "why": "because " * (i % 20)}) for i in range(n)]
    validator = jsonschema.Draft202012Validator(SCHEMA)
    started = time.perf_counter()
    valid = sum(1 for c in completions if validator.is_valid(json.loads(c)))
    direct_rate = n / (time.perf_counter() - started)
    scorer = JsonSchemaBatchScorer(JsonSchemaReward(json_schema=SCHEMA))
    try:
        scorer.score(completions[:batch], [{}] * batch)  # warm-up: the child is running, jsonschema imported
        started = time.perf_counter()
        conforming = 0.0
        for i in range(0, n, batch):
            chunk = completions[i:i + batch]
            out = scorer.score(chunk, [{}] * len(chunk))
            assert all(e is None for e in out.errors), out.errors[:3]
            conforming += sum(out.scores)
        child_rate = n / (time.perf_counter() - started)
    finally:
        scorer.close()
    assert conforming == valid
    return direct_rate, child_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--spin", type=int, default=0, help="empty loop iterations per row (a costlier reward)")
    args = parser.parse_args()
    source = SOURCE.format(spin=args.spin)
    if sandbox_level() != "namespaces":
        sys.exit("this host cannot sandbox user code (sandbox_level() is 'none'); nothing to compare")

    completions, rows = make_rows(args.rows)
    base = direct(source, completions, rows)
    started = time.perf_counter()
    with PythonRewardProcess(source) as one:
        one.score(completions[:1], rows[:1])
        startup_ms = (time.perf_counter() - started) * 1000

    print(f"{args.rows} rows, spin {args.spin}; sandbox start-up (spawn + load the source): {startup_ms:.0f} ms")
    print(f"{'mode':<22}{'batch':>7}{'rows/s':>12}{'vs direct':>11}")
    print(f"{'direct (in-process)':<22}{'-':>7}{base:>12,.0f}{1.0:>10.2f}x")
    for n in args.processes:
        for batch in args.batches:
            scorer = PythonRewardProcess(source) if n == 1 else PythonRewardPool(source, processes=n)
            with scorer:
                rate = sandboxed(scorer, completions, rows, batch)
            label = "sandbox, 1 process" if n == 1 else f"sandbox pool, {n} procs"
            print(f"{label:<22}{batch:>7}{rate:>12,.0f}{rate / base:>10.3f}x")
    for batch in args.batches:
        direct_rate, child_rate = regex_rates(completions, batch)
        print(f"{'regex in-process':<22}{batch:>7}{direct_rate:>12,.0f}{1.0:>10.2f}x")
        print(f"{'regex child':<22}{batch:>7}{child_rate:>12,.0f}{child_rate / direct_rate:>10.3f}x")
    for batch in args.batches:
        direct_rate, child_rate = schema_rates(args.rows, batch)
        print(f"{'json_schema in-proc.':<22}{batch:>7}{direct_rate:>12,.0f}{1.0:>10.2f}x")
        print(f"{'json_schema child':<22}{batch:>7}{child_rate:>12,.0f}{child_rate / direct_rate:>10.3f}x")


if __name__ == "__main__":
    main()
