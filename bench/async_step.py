"""Steps per second of asynchronous rollouts (rollout.max_staleness 0, 1, 2), side by side in one run.

    .venv/bin/python bench/async_step.py                          # toy and trl-small, 8 measured steps each
    .venv/bin/python bench/async_step.py --workloads toy --steps 3 --warmup 1 --staleness 0 1   # quick look

Two workloads: the toy task (worker/toy: a tiny model, 16 prompts x 8
completions of 4 tokens, LoRA) and bench/trl_compare.py's small default
(a random 384-wide Llama, 4 prompts x 4 completions of 64 tokens, LoRA r=16).
For each, one whole Trainer.run per max_staleness (a fresh trainer, the same
seed), interleaved so all see the same machine; the first --warmup steps
(model load, the sampler's start, the pipeline filling) are left out.

Per run it prints steps/s (over the measured steps, wall clock between step
ends) and each phase's mean time per step: rollout (sampling; in the sampler
process when asynchronous), reward (the scorer's calls), update (the
optimizer steps), other (the rest of the trainer's step), and the waits of
asynchronous runs: rollout_wait (the trainer waiting for a batch) and
update_wait (the sampler waiting for weights). Then the overlap bound, the
synchronous step time over its longest phase (the most that overlapping the
phases can give), and the achieved speed-up over max_staleness 0 as a ratio
and as a share of the bound. The load average is printed beside every row: the
machine is shared, and the figures move with it.

ASYNC_STEP_TOY_DIR names a prepared toy directory (python -m worker.toy DIR) to reuse instead of building one.

Threads: the synchronous run uses all of torch's threads (--threads, default
torch's); an asynchronous run splits them between the trainer and the sampler
process (worker/rollout/thread_split.py: one core each on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from worker.trainer.callbacks import NoCallbacks  # noqa: E402  (torch-light: a Protocol and a no-op class)

PHASES = ("rollout", "reward", "update", "other")


class TimedScorer:
    """The trainer's scorer, timing each call (from whichever thread makes it)."""

    def __init__(self, scorer):
        self.scorer, self.calls = scorer, []  # (start, seconds)
        self._lock = threading.Lock()

    def score(self, completions, rows, *, failure_score):
        started = time.perf_counter()
        try:
            return self.scorer.score(completions, rows, failure_score=failure_score)
        finally:
            with self._lock:
                self.calls.append((started, time.perf_counter() - started))

    def close(self):
        self.scorer.close()

    def seconds_between(self, start: float, end: float) -> float:
        with self._lock:
            return sum(s for t, s in self.calls if start <= t <= end)


@dataclass
class Run:
    """One Trainer.run's measured steps."""

    max_staleness: int
    ends: list[float] = field(default_factory=list)  # perf_counter at each step's on_step
    metrics: list[dict] = field(default_factory=list)
    reward_s: float = 0.0  # scorer seconds per measured step
    load: float = 0.0

    def measured(self, warmup: int) -> list[dict]:
        return self.metrics[warmup:]

    def steps_per_second(self, warmup: int) -> float:
        steps = len(self.ends) - warmup
        return steps / (self.ends[-1] - self.ends[warmup - 1])

    def phases(self, warmup: int) -> dict[str, float]:
        rows = self.measured(warmup)

        def mean(key: str) -> float:
            return statistics.fmean(m.get(key, 0.0) for m in rows)

        step = 1.0 / self.steps_per_second(warmup)
        rollout, update = mean("rollout_seconds"), mean("update_seconds")
        out = {"step": step, "rollout": rollout, "reward": self.reward_s, "update": update,
               "rollout_wait": mean("rollout_wait_s"), "update_wait": mean("update_wait_s"),
               "lag_mean": mean("policy_lag_mean")}
        # The trainer's own step: synchronously everything; asynchronously sampling and scoring are elsewhere.
        trainer = step - update - (out["rollout_wait"] if self.max_staleness else rollout + self.reward_s)
        out["other"] = max(0.0, trainer)
        return out


class Recorder(NoCallbacks):
    def __init__(self, run: Run):
        self.run = run

    def on_step(self, step, metrics):
        self.run.ends.append(time.perf_counter())
        self.run.metrics.append(metrics)


def measure(raw_spec: dict, max_staleness: int, *, steps: int, warmup: int, out: Path,
            reward_fn: Callable | None) -> Run:
    from service.job_spec.spec import JobSpec
    from worker.trainer.loop import Trainer

    raw = {**raw_spec, "rollout": {**raw_spec.get("rollout", {}), "max_staleness": max_staleness}}
    raw["training"] = {**raw["training"], "steps": warmup + steps, "eval_interval": 0, "checkpoint_interval": 0,
                       "eval_max_rows": 4, "preflight_groups": 0}
    trainer = Trainer(JobSpec.model_validate(raw), out, reward_fn=reward_fn, resume=False)
    timed = trainer.scorer = TimedScorer(trainer.scorer)
    run = Run(max_staleness)
    trainer.run(Recorder(run))
    run.reward_s = timed.seconds_between(run.ends[warmup - 1], run.ends[-1]) / steps
    run.load = os.getloadavg()[0]
    return run


def workloads(names: list[str], workdir: Path) -> dict[str, tuple[str, dict, Callable | None]]:
    """name -> (description, our spec as JSON, an in-process reward function or None)."""
    found = {}
    if "toy" in names:
        from worker.toy.__main__ import prepare, toy_spec

        toy = Path(os.environ.get("ASYNC_STEP_TOY_DIR") or workdir / "toy")
        if not (toy / "spec.yaml").exists():
            prepare(toy)
        raw = toy_spec(toy)
        tc = raw["training"]
        found["toy"] = (f"toy task: tiny Llama, {tc['batch_size']} prompts x {tc['group_size']} completions of "
                        f"{raw['sampling']['max_output_tokens']} tokens, LoRA r={raw['lora']['r']}, "
                        f"{tc['mini_batches']} mini-batches", raw, None)
    if "trl-small" in names:
        from bench.trl_compare import Workload, build_model, our_spec, reward, write_prompts

        w = Workload()
        model = build_model(workdir / "trl-small" / "model", w)
        write_prompts(workdir / "trl-small" / "train.jsonl", w)
        found["trl-small"] = (f"bench/trl_compare.py small: random Llama (hidden {w.hidden}, {w.layers} layers, "
                              f"vocab {w.vocab}), {w.batch} prompts x {w.group} completions of {w.max_tokens} "
                              f"tokens, LoRA r={w.lora_r}, 1 optimizer step",
                              our_spec(model, workdir / "trl-small" / "train.jsonl", w), reward)
    return found


def report(name: str, description: str, runs: list[Run], warmup: int) -> dict[int, float]:
    """Print one workload's rows and its bound; return the speed-up of each max_staleness over 0."""
    print(f"\n== {name}: {description}; {len(runs[0].ends) - warmup} measured steps per run")
    print(f"{'s':>2} {'steps/s':>8} {'step_s':>7} " + " ".join(f"{p:>8}" for p in PHASES)
          + f" {'roll_wait':>9} {'upd_wait':>8} {'lag':>5} {'speed-up':>8} {'load':>5}")
    base = next(r for r in runs if r.max_staleness == 0)
    base_rate = base.steps_per_second(warmup)
    speedups = {}
    for run in runs:
        ph, rate = run.phases(warmup), run.steps_per_second(warmup)
        speedups[run.max_staleness] = rate / base_rate
        print(f"{run.max_staleness:>2} {rate:8.3f} {ph['step']:7.3f} " + " ".join(f"{ph[p]:8.3f}" for p in PHASES)
              + f" {ph['rollout_wait']:9.3f} {ph['update_wait']:8.3f} {ph['lag_mean']:5.2f} "
              f"{rate / base_rate:7.2f}x {run.load:5.2f}")
    sync = base.phases(warmup)
    longest = max(PHASES[:3], key=lambda p: sync[p])
    bound = sync["step"] / sync[longest]
    print(f"overlap bound (sync step {sync['step']:.3f} s / longest phase, {longest} {sync[longest]:.3f} s): "
          f"{bound:.2f}x")
    if any(r.max_staleness and r.phases(warmup)["update"] < 0.9 * sync["update"] for r in runs):
        print("note: the asynchronous update is cheaper here: logp_old is the sampler's, so the frozen forward that "
              "recomputes it for a multi-mini-batch step is skipped; the speed-up can exceed the bound")
    for s, speedup in speedups.items():
        if s:
            print(f"achieved at max_staleness {s}: {speedup:.2f}x = {speedup / bound:.0%} of the bound "
                  f"(load average {next(r.load for r in runs if r.max_staleness == s):.2f})")
    return speedups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["toy", "trl-small"], choices=["toy", "trl-small"])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps per run left out (at least 1)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the trainer (0: torch's default)")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each row as it is measured, also into a file
    if args.warmup < 1 or 0 not in args.staleness:
        parser.error("--warmup must be at least 1 and --staleness must include 0 (the baseline)")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()} ({os.cpu_count()} CPUs); load average at start "
          f"{os.getloadavg()[0]:.2f} (a shared machine: figures move with the load)", flush=True)
    if os.getloadavg()[0] > (os.cpu_count() or 1) and torch.get_num_threads() > 1:
        print("warning: the load is above the CPU count: a multi-threaded synchronous step is preempted "
              "mid-matmul (its threads wait on each other), which flatters the split; --threads 1 is steadier")
    with tempfile.TemporaryDirectory(prefix="async-step-") as tmp:
        for name, (description, raw, reward_fn) in workloads(args.workloads, Path(tmp)).items():
            runs = [measure(raw, s, steps=args.steps, warmup=args.warmup, out=Path(tmp) / f"{name}-{s}",
                            reward_fn=reward_fn) for s in args.staleness]
            report(name, description, runs, args.warmup)


if __name__ == "__main__":
    main()
