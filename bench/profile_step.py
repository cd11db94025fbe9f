"""Where one of our CISPO steps spends its time: torch.profiler over one step, after one unprofiled warm-up step.

    .venv/bin/python bench/profile_step.py --shape qwen2.5-0.5b     # ~2 min at load 1

The workload is bench/trl_compare.py's (the same model, prompts and spec). Prints
the step's phases (rollout, update), the operators with the most self CPU time,
and the Python-level regions (`record_function` labels and module calls) with
the most total time. The load average is printed beside: on a shared machine
the absolute times move with it, the shares much less.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.trl_compare import SHAPES, Workload, build_model, our_trainer, write_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=list(SHAPES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=25, help="operators listed")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per completion (default: the shape's)")
    parser.add_argument("--warmup", type=int, default=1, help="unprofiled steps first")
    args = parser.parse_args()
    shape = dict(SHAPES[args.shape])
    if args.max_tokens is not None:
        shape["max_tokens"] = args.max_tokens
    w = Workload(**shape, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model(work / "model", w)
        write_prompts(work / "train.jsonl", w)
        trainer = our_trainer(work / "model", work / "train.jsonl", work / "ours", w)
        for _ in range(args.warmup):
            started = time.perf_counter()
            warm = trainer.train_step()
            print(f"warm-up step {time.perf_counter() - started:.1f} s (rollout {warm['rollout_seconds']:.1f} s, "
                  f"update {warm['update_seconds']:.1f} s); load {os.getloadavg()[0]:.1f}", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            cpu, started = time.process_time(), time.perf_counter()
            metrics = trainer.train_step()
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    print(f"profiled step {wall:.1f} s wall, {cpu:.1f} s CPU (rollout {metrics['rollout_seconds']:.1f} s, "
          f"update {metrics['update_seconds']:.1f} s); load {os.getloadavg()[0]:.1f}; "
          f"torch threads {torch.get_num_threads()}")
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
