"""Our rollout decode alone against its floor on this machine, with an optional operator profile.

    flock /tmp/bigmem.lock .venv/bin/python bench/decode_floor.py --shape qwen2.5-0.5b --repeats 3
    .venv/bin/python bench/decode_floor.py --profile 20    # the small shape, the top 20 operators (torch.profiler)

bench/trl_compare.py's workload (the same random Llama, prompts, LoRA and
sampling spec, built through our Trainer), but only the sampler: `repeats`
timed calls of the trainer's own transformers sampler on one batch of
prompts x group rows, after one warm-up call. Prints the median against the
decode floor (bench/floors.py: the larger of weight-and-cache bytes /
measured bandwidth and FLOPs / measured matmul rate), the per-step time and
the load average beside them. A decode-only run takes a minute where the
full comparison takes ten, so a change to worker/rollout/ can be measured
before and after in the same conditions.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from bench.trl_compare import (Workload, add_workload_args, measure_machine, scratch_trainer,  # noqa: E402
                                workload_from)


def time_decode(trainer, w: Workload, *, repeats: int, profile_rows: int = 0) -> list[float]:
    """Seconds of each of `repeats` sampler calls (one warm-up call first) on the workload's first prompts."""
    from worker.rollout import sampling_dtype
    from worker.rollout.rollout import TransformersSampler

    policy = trainer.policy
    sampler = TransformersSampler(policy, trainer.spec.sampling, dtype=sampling_dtype(trainer.spec, policy))
    prompts = [policy.tokenizer(line)["input_ids"] for line in _prompt_lines(trainer, w)]
    rows = [p for p in prompts for _ in range(w.group)]
    seeds = list(range(len(rows)))

    def call():
        started = time.perf_counter()
        tokens, _ = sampler(rows, [w.max_tokens] * len(rows), greedy=False, seeds=seeds)
        elapsed = time.perf_counter() - started
        assert all(len(t) <= w.max_tokens for t in tokens)
        return elapsed

    call()
    times = [call() for _ in range(repeats)]
    if profile_rows:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=profile_rows,
                                        max_name_column_width=60))
    return times


def _prompt_lines(trainer, w: Workload) -> list[str]:
    import json

    lines = Path(trainer.spec.data.train_file).read_text().splitlines()[: w.batch]
    return [json.loads(line)["prompt"] for line in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--repeats", type=int, default=3, help="timed decode calls (after one warm-up)")
    parser.add_argument("--profile", type=int, default=0, help="profile one more call; list this many operators")
    parser.add_argument("--rollout-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="rollout.dtype (the floor is taken in it: bfloat16 reads half the bytes)")
    args = parser.parse_args()
    w = workload_from(args, rollout_dtype=args.rollout_dtype)
    from bench.floors import decode_bytes, decode_flops, floor_seconds

    print(f"torch threads {torch.get_num_threads()}; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    machine = measure_machine()
    with scratch_trainer(w) as trainer:
        times = time_decode(trainer, w, repeats=args.repeats, profile_rows=args.profile)
    shape, step = w.shape(), w.step()
    dtype = w.dtype if w.rollout_dtype == "auto" else w.rollout_dtype
    step = dataclasses.replace(step, dtype_bytes=getattr(torch, dtype).itemsize)
    floor = floor_seconds(decode_bytes(shape, step), decode_flops(shape, step), machine["bandwidth"],
                          machine[dtype])
    median = statistics.median(times)
    print(f"{w.describe(sum(p.numel() for p in trainer.policy.model.parameters()))}")
    print(f"machine: read bandwidth {machine['bandwidth'] / 1e9:.1f} GB/s, {dtype} matmul "
          f"{machine[dtype] / 1e9:.0f} GFLOP/s (load {machine['load']:.1f})")
    print(f"decode: median {median:.2f} s of {['%.2f' % t for t in times]} = {median / floor:.2f}x its "
          f"{floor:.2f} s floor ({1000 * median / w.max_tokens:.0f} ms/step); load average "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
