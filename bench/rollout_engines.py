"""Rollout throughput: the vLLM engine vs transformers generation (the peer), in one run, same model and prompts.

    python bench/rollout_engines.py [--prompts 64 --group 8 --tokens 24 --repeats 3]

Builds the toy task's model with vLLM-compatible heads (worker/toy, 2 heads of
32) in a temporary directory, attaches a LoRA adapter with non-zero weights,
then samples the same rollout batch (prompts x group, temperature 1) with
both engines through the trainer's rollout path. Prints sampled tokens/s per
engine, the ratio against transformers, and the per-step cost of pushing the
adapter to vLLM (save_pretrained + a new LoRA id + its first request).
Needs vllm (`make install`). On CPU the figures say little about a GPU.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from service.job_spec.spec import JobSpec
from worker.rollout import HFEngine
from worker.toy.__main__ import prepare, toy_spec
from worker.toy.task import make_rows
from worker.toy.tiny_model import build_tiny_model
from worker.model.policy import load_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24, help="max_output_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    build_tiny_model(root / "model", attention_heads=2, pretrain_steps=20)
    prepare(root)
    raw = toy_spec(root)
    raw["sampling"] = {"temperature": 1.0, "max_output_tokens": args.tokens, "max_model_len": args.tokens + 16}
    raw["rollout"] = {"engine": "vllm"}
    spec = JobSpec.model_validate(raw)
    policy = load_policy(spec, resume_from=None, warm_start=None)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    rows = make_rows(args.prompts, seed=3)

    from worker.rollout.vllm_engine import VLLMEngine

    started = time.perf_counter()
    vllm = VLLMEngine(spec, lora=True)
    print(f"vllm engine start: {time.perf_counter() - started:.1f} s")
    engines = {"transformers": HFEngine(), "vllm": vllm}
    results = {}
    for name, engine in engines.items():
        engine.generate(policy, rows[:4], spec.sampling, group_size=2)  # warm-up
        times, tokens = [], 0
        for r in range(args.repeats):
            torch.manual_seed(r)
            t = time.perf_counter()
            rollout = engine.generate(policy, rows, spec.sampling, group_size=args.group)
            times.append(time.perf_counter() - t)
            tokens += sum(rollout.action_counts)
        results[name] = tokens / sum(times)
    sync = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        vllm.sync(policy.model)
        vllm.sample([[1, 5, 6, 44]], [1], greedy=True)  # the adapter loads on its first request
        sync.append(time.perf_counter() - t)
    vllm.close()

    print(f"{args.prompts} prompts x {args.group} samples, up to {args.tokens} tokens, {args.repeats} repeats, "
          f"{torch.get_num_threads()} torch threads, {'cuda' if torch.cuda.is_available() else 'cpu'}")
    print("| engine | sampled tokens/s | vs transformers |\n|---|---:|---:|")
    for name, rate in results.items():
        print(f"| {name} | {rate:,.0f} | {rate / results['transformers']:.2f}x |")
    print(f"adapter push (save + new LoRA id + first request): {1000 * sum(sync) / len(sync):.0f} ms")


if __name__ == "__main__":
    main()
