"""Does bfloat16 compute on a CPU learn the toy task as float32 does? The evidence for `dtype: auto` on CPUs.

    .venv/bin/python bench/bf16_learning.py                    # seeds 1-3, both dtypes (~15 min on 2 busy cores)
    .venv/bin/python bench/bf16_learning.py --seeds 1 2 3 4 5 --steps 60

Runs tests/worker/trainer/test_trainer.py's learning test (the toy job, LoRA,
60 steps) once per seed and dtype, the runs of one seed back to back so both
see the same machine load, and prints per run the train reward (mean of the
first and last 10 steps), the greedy eval reward before and after, the
seconds per step and the load average; then per dtype the mean gains over
seeds. bfloat16 here is the trainer's mixed precision (float32 master
weights, forwards under a bf16 autocast, rollouts in bf16 with the TIS
correction).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run_once(toy: Path, out: Path, *, seed: int, dtype: str, steps: int) -> dict:
    from service.job_spec.spec import JobSpec
    from worker.toy.__main__ import toy_spec
    from worker.trainer.callbacks import NoCallbacks
    from worker.trainer.loop import train

    rewards: list[float] = []

    class Collect(NoCallbacks):
        def on_step(self, step, metrics):
            rewards.append(metrics["reward_mean"])

    spec = JobSpec.model_validate({**toy_spec(toy, steps=steps), "seed": seed, "dtype": dtype})
    started = time.perf_counter()
    result = train(spec, out, callbacks=Collect())
    k = min(10, len(rewards) // 2)
    return {"seed": seed, "dtype": dtype, "train_first": sum(rewards[:k]) / k, "train_last": sum(rewards[-k:]) / k,
            "eval_first": result.first_eval["eval_reward_mean"], "eval_last": result.last_eval["eval_reward_mean"],
            "s_per_step": (time.perf_counter() - started) / len(rewards), "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--toy", type=Path, help="a prepared toy directory (python -m worker.toy DIR); default: built")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    import torch

    from worker.toy.__main__ import prepare

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        toy = args.toy or Path(tmp) / "toy"
        if args.toy is None:
            prepare(toy, steps=args.steps)
        runs = []
        print(f"{'dtype':<9} {'seed':>4} {'train reward':>16} {'eval reward':>16} {'s/step':>7} {'load':>5}")
        for seed in args.seeds:
            for dtype in args.dtypes:
                r = run_once(toy, Path(tmp) / f"{dtype}-{seed}", seed=seed, dtype=dtype, steps=args.steps)
                runs.append(r)
                print(f"{dtype:<9} {seed:>4} {r['train_first']:7.3f} -> {r['train_last']:.3f} "
                      f"{r['eval_first']:7.3f} -> {r['eval_last']:.3f} {r['s_per_step']:7.3f} {r['load']:5.1f}",
                      flush=True)
    for dtype in args.dtypes:
        mine = [r for r in runs if r["dtype"] == dtype]
        train_gain = statistics.mean(r["train_last"] - r["train_first"] for r in mine)
        eval_gains = [r["eval_last"] - r["eval_first"] for r in mine]
        print(f"{dtype}: mean train gain {train_gain:+.3f}, mean eval gain {statistics.mean(eval_gains):+.3f} "
              f"(per seed {', '.join(f'{g:+.3f}' for g in eval_gains)}), "
              f"median {statistics.median(r['s_per_step'] for r in mine):.3f} s/step")


if __name__ == "__main__":
    main()
