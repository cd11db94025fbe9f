"""K toy LoRA jobs of one base trained together on one resident base vs the same jobs one after another.

    .venv/bin/python bench/multi_job.py                  # K = 1, 2, 4 (and --ks 1,2,4,8), a few minutes on 2 CPUs
    .venv/bin/python bench/multi_job.py --steps 6 --ks 1,2,4,8

Each configuration runs in a fresh child process (its peak RSS is its own):
- sequential K: the K jobs one after another, each by today's trainer (worker/trainer/loop.py: its own base);
- shared K: the K jobs resident on one base, advanced by cycles (worker/multi/cycle.py).
The jobs differ in seed only (same shapes); each runs its pre-flight-free run of --steps steps with the step-0 and
final evaluation and the final checkpoint, as a job does. Printed: aggregate steps/s and sampled tokens/s, and the
ratios shared / sequential by wall time and by CPU time (steps per CPU-second: on a loaded, shared machine the
steadier figure, since waiting for a core costs wall time but no CPU time), peak RSS against one job alone, with
the load average beside them. Each configuration runs --repeats times, the best kept.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _spec(toy_dir: Path, seed: int, steps: int):
    from service.job_spec.spec import JobSpec
    from worker.toy.__main__ import toy_spec

    raw = toy_spec(toy_dir)
    raw["seed"] = seed
    raw["training"].update({"steps": steps, "batch_size": 8, "group_size": 4, "mini_batches": 1,
                            "micro_batch_size": 32, "eval_interval": 0, "eval_max_rows": 8, "checkpoint_interval": 0,
                            "preflight_groups": 0})
    return JobSpec.model_validate(raw)


class _Count:
    def __init__(self, sequences: int):
        self.sequences, self.steps, self.tokens = sequences, 0, 0.0

    def on_step(self, step, metrics):
        self.steps += 1
        self.tokens += metrics["completion_length_mean"] * self.sequences

    def on_eval(self, step, metrics): pass
    def on_checkpoint(self, step, path): pass
    def should_stop(self): return False


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(mode: str, k: int, steps: int, toy_dir: Path, threads: int) -> dict:
    """One configuration, in this (fresh) process."""
    import torch

    torch.set_num_threads(threads)
    from worker.toy.task import reward

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.multi.cycle import run_cycle
    from worker.multi.job import ResidentJob
    from worker.multi.lora import SharedBase
    from worker.trainer.loop import Trainer

    specs = [_spec(toy_dir, seed, steps) for seed in range(k)]
    counts = [_Count(s.training.batch_size * s.training.group_size) for s in specs]
    out = Path(tempfile.mkdtemp(prefix="multi-job-bench-"))
    started = time.perf_counter()  # imports done: both modes pay loading the model, the jobs' starts and ends
    cpu_started = _cpu_seconds()
    if mode == "sequential":
        for i, (spec, count) in enumerate(zip(specs, counts)):
            Trainer(spec, out / f"job-{i}", reward_fn=reward).run(count)
    else:
        cpu = torch.device("cpu")
        tok = AutoTokenizer.from_pretrained(specs[0].model)
        tok.padding_side = "left"
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        shared = SharedBase(AutoModelForCausalLM.from_pretrained(specs[0].model, dtype=torch.float32))
        jobs = [ResidentJob(spec, out / f"job-{i}", shared, tok, cpu, name=f"job-{i}", reward_fn=reward,
                            callbacks=count) for i, (spec, count) in enumerate(zip(specs, counts))]
        for job in jobs:
            job.start()
        while live := [job for job in jobs if not job.done]:
            failures = run_cycle(shared, live, device=cpu)
            if failures:
                raise RuntimeError(f"jobs failed: {failures}")
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu_started
    return {"seconds": seconds, "cpu_seconds": cpu, "steps": sum(c.steps for c in counts), "tokens": sum(c.tokens for c in counts),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "load": os.getloadavg()[0]}


def _run(mode: str, k: int, args) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--k", str(k), "--steps", str(args.steps),
           "--toy-dir", str(args.toy_dir), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{mode} K={k} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _best(mode: str, k: int, args) -> dict:
    """The fastest of --repeats runs (wall and CPU time each at its best): on a shared machine the slower runs
    measure the neighbours."""
    runs = [_run(mode, k, args) for _ in range(args.repeats)]
    return {**min(runs, key=lambda r: r["seconds"]), "cpu_seconds": min(r["cpu_seconds"] for r in runs),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "load": sum(r["load"] for r in runs) / len(runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="1,2,4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, the best kept")
    parser.add_argument("--toy-dir", type=Path, default=None)
    parser.add_argument("--child", choices=["sequential", "shared"])
    parser.add_argument("--k", type=int)
    args = parser.parse_args()
    if args.toy_dir is None:
        from worker.toy.__main__ import prepare

        args.toy_dir = Path(os.environ.get("CISPO_TEST_TOY_DIR") or tempfile.mkdtemp(prefix="toy-"))
        if not (args.toy_dir / "spec.yaml").exists():
            prepare(args.toy_dir)
    if args.child:
        print(json.dumps(child(args.child, args.k, args.steps, args.toy_dir, args.threads)))
        return
    ks = [int(k) for k in args.ks.split(",")]
    one = _best("sequential", 1, args)  # one job alone: the memory reference
    print(f"{args.steps} steps a job, batch 8 x group 4, {args.threads} thread(s), best of {args.repeats}; one job "
          f"alone: {one['steps'] / one['seconds']:.2f} steps/s, peak RSS {one['peak_rss_mb']:.0f} MB "
          f"(load {one['load']:.2f})")
    print("| K | sequential steps/s | shared steps/s | wall x | shared tokens/s | tokens x | CPU-time x "
          "| shared peak RSS MB | vs one job | load seq / shared |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k in ks:
        seq = one if k == 1 else _best("sequential", k, args)
        sh = _best("shared", k, args)
        seq_rate, sh_rate = seq["steps"] / seq["seconds"], sh["steps"] / sh["seconds"]
        seq_tok, sh_tok = seq["tokens"] / seq["seconds"], sh["tokens"] / sh["seconds"]
        cpu_x = (sh["steps"] / sh["cpu_seconds"]) / (seq["steps"] / seq["cpu_seconds"])
        print(f"| {k} | {seq_rate:.2f} | {sh_rate:.2f} | {sh_rate / seq_rate:.2f}x | {sh_tok:.0f} | "
              f"{sh_tok / seq_tok:.2f}x | {cpu_x:.2f}x | {sh['peak_rss_mb']:.0f} | "
              f"{sh['peak_rss_mb'] / one['peak_rss_mb']:.2f}x | {seq['load']:.1f} / {sh['load']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
