"""Sequence packing (training.pack_tokens) against padded micro-batches: tokens forwarded and update seconds.

    .venv/bin/python bench/packing.py                        # the small shape, ~2 min at load 2

One rollout batch is built by hand (no sampling): `--prompts` prompts of `--prompt-tokens` tokens, `--group`
completions each, whose lengths are drawn from a long tail (most short, a few near `--max-tokens`), as RL
completions are; `--uniform` draws them all near `--max-tokens` instead. The same Updater runs one optimizer step
(mini_batches 1: no frozen old-policy pass) on it padded (micro_batch_size, the default's shared-prompt pass
included) and packed (pack_tokens), alternately, `--repeats` times each. Printed: tokens the model's forwards
took (padding and repeated prompts included), the median update seconds, their ratios, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.trl_compare import SHAPES, Workload, build_model, our_spec, write_prompts  # noqa: E402


def completion_lengths(n: int, max_tokens: int, uniform: bool, g: torch.Generator) -> list[int]:
    if uniform:
        return torch.randint(max(1, max_tokens * 3 // 4), max_tokens + 1, (n,), generator=g).tolist()
    # a long tail: exponential with mean max_tokens / 6, capped at max_tokens
    drawn = torch.empty(n).exponential_(6.0 / max_tokens, generator=g)
    return drawn.ceil().clamp(1, max_tokens).long().tolist()


def rollout_of(args, vocab: int):
    from worker.rollout.rollout import Rollout

    g = torch.Generator().manual_seed(0)
    token_ids, masks = [], []
    lengths = completion_lengths(args.prompts * args.group, args.max_tokens, args.uniform, g)
    for p in range(args.prompts):
        prompt = torch.randint(4, vocab, (args.prompt_tokens,), generator=g).tolist()
        for c in range(args.group):
            n = lengths[p * args.group + c]
            token_ids.append(prompt + torch.randint(4, vocab, (n,), generator=g).tolist())
            masks.append([0] * len(prompt) + [1] * n)
    n = len(token_ids)
    rollout = Rollout(rows=[{}] * n, token_ids=token_ids, action_mask=masks, action_turns=[[0] * sum(m) for m in masks],
                      prompt_lengths=[args.prompt_tokens] * n, completions=[""] * n, truncated=[False] * n,
                      turns=[1] * n)
    return rollout, torch.randn(n, generator=g)


def counted_tokens(model) -> tuple[list[int], object]:
    """A running count of the tokens every forward of `model` (a PeftModel) takes, and the hook to remove."""
    count = [0]
    embed = model.get_base_model().get_input_embeddings()
    hook = embed.register_forward_hook(lambda _m, args, _out: count.__setitem__(0, count[0] + args[0].numel()))
    return count, hook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="small", choices=list(SHAPES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--pack-tokens", type=int, default=None, help="default: micro-batch-size x the longest row")
    parser.add_argument("--uniform", action="store_true", help="completions all near --max-tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from service.job_spec.spec import JobSpec
    from worker.model.policy import load_policy
    from worker.trainer.update import Updater

    shape = {k: v for k, v in SHAPES[args.shape].items() if k not in ("prompt_tokens", "max_tokens")}
    w = Workload(**shape, batch=args.prompts, group=args.group, prompt_tokens=args.prompt_tokens,
                 max_tokens=args.max_tokens)
    rollout, advantages = rollout_of(args, w.vocab)
    longest = max(map(len, rollout.token_ids))
    pack_tokens = args.pack_tokens or args.micro_batch_size * longest
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model(work / "model", w)
        write_prompts(work / "train.jsonl", w)
        raw = our_spec(work / "model", work / "train.jsonl", w)
        raw["training"]["micro_batch_size"] = args.micro_batch_size
        raw["sampling"]["max_model_len"] = longest + 1
        runs = {}
        for name, pack in (("padded", None), ("packed", pack_tokens)):
            spec = JobSpec.model_validate({**raw, "training": {**raw["training"], "pack_tokens": pack}})
            torch.manual_seed(0)
            policy = load_policy(spec, resume_from=None, warm_start=None)
            optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-5)
            runs[name] = (Updater(policy, optimizer, spec), policy, [], [0])
        indices = list(range(len(rollout)))
        for _ in range(args.repeats + 1):  # the first round warms up, uncounted
            for name, (updater, policy, seconds, tokens) in runs.items():
                count, hook = counted_tokens(policy.model)
                started = time.perf_counter()
                updater.run(rollout, advantages, indices)
                seconds.append(time.perf_counter() - started)
                hook.remove()
                tokens[0] = count[0]
        actions = sum(rollout.action_counts)
        real = sum(len(ids) - 1 for ids in rollout.token_ids)
        print(f"{len(rollout)} sequences ({args.prompts} prompts x {args.group}), {args.prompt_tokens}-token prompts, "
              f"completions {'near' if args.uniform else 'long-tailed up to'} {args.max_tokens} tokens "
              f"({actions} action tokens, {real} tokens unpadded); {args.shape} shape, LoRA r={w.lora_r}; "
              f"micro_batch_size {args.micro_batch_size} vs pack_tokens {pack_tokens}")
        medians = {}
        for name, (_, _, seconds, tokens) in runs.items():
            medians[name] = statistics.median(seconds[1:])
            print(f"  {name}: {tokens[0]} tokens forwarded, update {medians[name]:.2f} s (median of {args.repeats})")
        padded_tokens, packed_tokens = runs["padded"][3][0], runs["packed"][3][0]
        print(f"  packed / padded: tokens {packed_tokens / padded_tokens:.2f}x "
              f"({padded_tokens - packed_tokens} fewer), update time {medians['packed'] / medians['padded']:.2f}x; "
              f"load {os.getloadavg()[0]:.2f} (1-min), torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
