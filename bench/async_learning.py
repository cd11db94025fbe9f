"""Does the toy task learn as well with asynchronous rollouts? The learning test's runs at several max_staleness.

    OMP_NUM_THREADS=1 .venv/bin/python bench/async_learning.py --toy DIR --out results.jsonl
    OMP_NUM_THREADS=1 .venv/bin/python bench/async_learning.py --toy DIR --out unmasked.jsonl --staleness 1 \
        --loss '{"off_policy_mask": null}'
    OMP_NUM_THREADS=1 .venv/bin/python bench/async_learning.py --toy DIR --out trl.jsonl --staleness 0 \
        --set '{"advantages": {"scale": "group_std"}, "optimizer": {"betas": [0.9, 0.999], "eps": 1e-8}}'
    .venv/bin/python bench/async_learning.py --summary results.jsonl

Each run is tests/worker/trainer/test_trainer.py::test_cispo_learns_the_toy_task's (the toy spec, 60 steps, one
seed): it records the train-reward gain (mean of the last 10 steps minus the first 10) and the greedy eval
gain (last eval minus the step-0 eval). Runs are interleaved (seed 1 at every staleness, then seed 2, ...),
each appended to --out as one JSON line as it finishes, so a run cut short still leaves balanced results.
--loss replaces the spec's loss section, --set merges fields into any sections (a run records both; a stale
run without an off_policy_mask gets the spec's default one). --summary prints the mean and the spread
(min..max) over seeds for each max_staleness, loss and --set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))


def learning_run(toy: Path, seed: int, max_staleness: int, out_dir: Path, loss: dict | None = None,
                 sections: dict | None = None) -> dict:
    from service.job_spec.spec import JobSpec
    from worker.toy.__main__ import toy_spec
    from worker.trainer.callbacks import NoCallbacks
    from worker.trainer.loop import train

    rewards: list[float] = []

    class Collect(NoCallbacks):
        def on_step(self, step, metrics):
            rewards.append(metrics["reward_mean"])

    raw = {**toy_spec(toy), "seed": seed, "rollout": {"max_staleness": max_staleness}}
    if loss:
        raw["loss"] = loss
    for name, values in (sections or {}).items():  # e.g. {"optimizer": {"eps": 1e-8}}: merged into that section
        raw[name] = {**raw.get(name, {}), **values}
    spec = JobSpec.model_validate(raw)
    started = time.perf_counter()
    result = train(spec, out_dir, callbacks=Collect())
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    before, after = result.first_eval["eval_reward_mean"], result.last_eval["eval_reward_mean"]
    return {"seed": seed, "max_staleness": max_staleness, "train_gain": last - first, "eval_before": before,
            "eval_after": after, "eval_gain": after - before, "seconds": time.perf_counter() - started,
            "load": os.getloadavg()[0], **({"loss": loss} if loss else {}),
            **({"sections": sections} if sections else {})}


def summary(path: Path) -> str:
    runs = defaultdict(list)
    for line in path.read_text().splitlines():
        run = json.loads(line)
        runs[(run["max_staleness"], json.dumps(run.get("loss"), sort_keys=True),
              json.dumps(run.get("sections"), sort_keys=True))].append(run)
    lines = []
    for (s, loss, sections), group in sorted(runs.items()):
        train_gains, eval_gains = [r["train_gain"] for r in group], [r["eval_gain"] for r in group]
        lines.append(f"max_staleness={s}{'' if loss == 'null' else ' loss ' + loss}"
                     f"{'' if sections == 'null' else ' ' + sections}: seeds {[r['seed'] for r in group]}; "
                     "train gain mean "
                     f"{statistics.fmean(train_gains):+.3f} ({min(train_gains):+.3f}..{max(train_gains):+.3f}); "
                     f"eval gain mean {statistics.fmean(eval_gains):+.3f} "
                     f"({min(eval_gains):+.3f}..{max(eval_gains):+.3f}); "
                     f"{statistics.fmean(r['seconds'] for r in group):.0f} s a run at load "
                     f"{statistics.fmean(r['load'] for r in group):.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toy", type=Path, help="a prepared toy directory (python -m worker.toy DIR)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--loss", type=json.loads, default=None,
                        help='the spec\'s loss section as JSON, e.g. \'{"off_policy_mask": {"sequence_threshold": 0.03}}\'')
    parser.add_argument("--set", type=json.loads, default=None, dest="sections",
                        help='spec sections merged into the toy spec\'s, e.g. \'{"optimizer": {"betas": [0.9, 0.999], '
                             '"eps": 1e-8}, "advantages": {"scale": "group_std"}}\'')
    parser.add_argument("--summary", type=Path, help="print the summary of a results file and exit")
    args = parser.parse_args()
    if args.summary:
        print(summary(args.summary))
        return
    for seed in args.seeds:
        for s in args.staleness:
            with tempfile.TemporaryDirectory(prefix="async-learning-") as out_dir:
                run = learning_run(args.toy, seed, s, Path(out_dir), args.loss, args.sections)
            with args.out.open("a") as f:
                f.write(json.dumps(run) + "\n")
            print(json.dumps(run), flush=True)
    print(summary(args.out))


if __name__ == "__main__":
    main()
