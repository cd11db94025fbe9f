"""Does CISPO learn on a real instruct model? Greedy held-out reward before and after, per configuration and seed.

    make real-model          # runs/SmolLM2-135M-Instruct (worker/toy/real_model.py)
    nice -n 10 .venv/bin/python bench/real_learning.py --model runs/SmolLM2-135M-Instruct --out runs.jsonl \
        --task capitals --configs defaults group_std --seeds 0 1 --steps 20
    .venv/bin/python bench/real_learning.py --summary runs.jsonl
    .venv/bin/python bench/real_learning.py --model runs/SmolLM2-135M-Instruct --out probe.jsonl --steps 2  # time a run

Each run is a `cispo train` job in this process (worker/trainer/loop.py's Trainer) on SmolLM2-135M-Instruct with
the shared settings below and the spec's defaults for everything else, then one configuration's overrides
(CONFIGS). Two tasks with a checkable reward, the answer in as few words as it takes, each a recipe's rows and
reward (examples/<task>/build_dataset.py and job.yaml):
- capitals: "Paris" 1.0, "The capital of France is Paris." 0.5, wrong 0;
- arithmetic: "What is 23 + 48?" with two-digit operands drawn from a fixed seed, the number alone 1.0, a sentence
  ending in the right number less, a wrong number 0 (numeric_match on the last number times the same brevity).
Per run: the greedy held-out reward and exact match (the completion alone equals the answer, case and punctuation
ignored) at step 0 and every --eval-every steps, and per step the train reward, the share of groups with zero
reward variance (no signal), the share of truncated completions, the completion length, kl_old and clip_fraction;
the run's CPU time (this process's) and the load average. Runs go one after another (seed-major: every config at
seed 0, then at seed 1), each appended to --out as one JSON line as it finishes, so a run cut short still leaves
comparable results. --summary prints one line per run and the mean over seeds per task and config.

The config `trl` is the peer: TRL's own `trl.GRPOTrainer(loss_type="cispo")` (the `bench` extra) on the same task
rows and reward (our scorer, called from a TRL reward function), evaluated by the same code at the same steps: our
Trainer is built from the `defaults` job only to evaluate, its policy's model swapped for TRL's PEFT model, and a
TrainerCallback runs its evaluation at step 0 and every --eval-every rollouts (a step here is one rollout, 2 of
TRL's optimizer steps). TRL is given only the shared settings (TRL_SHARED): 8 prompts x 4 completions a rollout
(per_device_train_batch_size 16, steps_per_generation 2, num_generations 4), LoRA r 16 / alpha 32 / dropout 0 on
our target modules, learning_rate 2e-4, max_completion_length the job's max_output_tokens, float32 (bf16 off), the
run's seed, and bookkeeping that leaves the training alone (no saves or reports, a log every rollout, no
gradient checkpointing: compute only, the same gradients; the CPU where there is no GPU). Everything else is
TRL's default (trl 1.16): scale_rewards "group" (advantages divided by the group's std), AdamW ("adamw_torch_fused":
betas 0.9 / 0.999, eps 1e-8, weight decay 0), max_grad_norm 1, lr_scheduler_type "linear" (decay to 0 over the
run, no warmup), temperature 1 / top_p 1 / top_k 0, beta 0 (no KL), num_iterations 1, epsilon 0.2 and
epsilon_high unset (so its CISPO caps the IS weight at 0.2: every token's weight is 0.2 near on-policy), the
chat template and generation of its own. Per step from TRL's logs: reward, frac_reward_zero_std,
completions/clipped_ratio (truncated), completions/mean_length, entropy and cispo_clip_ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import importlib.util
import statistics
import string
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

# The shared settings: 8 prompts x 4 completions a step, 2 optimizer steps a rollout, LoRA r 16, lr 2e-4.
SHARED = {
    "lora": {"r": 16, "alpha": 32},
    "optimizer": {"lr": 2e-4},
    "training": {"batch_size": 8, "group_size": 4, "mini_batches": 2, "micro_batch_size": 32,
                 "checkpoint_interval": 0, "preflight_groups": 0, "eval_max_rows": 20},
}
TRL_ADAMW = {"betas": [0.9, 0.999], "eps": 1e-8}
CONFIGS = {  # name: sections merged into the shared settings
    "defaults": {},
    "group_std": {"advantages": {"scale": "group_std"}},
    "trl_adamw": {"optimizer": TRL_ADAMW},
    "group_std+trl_adamw": {"advantages": {"scale": "group_std"}, "optimizer": TRL_ADAMW},
    "tokens16": {"sampling": {"max_output_tokens": 16}},
    "tokens512": {"sampling": {"max_output_tokens": 512}},
    "eps1e-8": {"optimizer": {"eps": 1e-8}},
    "beta2_0.999": {"optimizer": {"betas": [0.9, 0.999]}},
    "lr1e-4": {"optimizer": {"lr": 1e-4}},
    "lr5e-4": {"optimizer": {"lr": 5e-4}},
    "all_linear": {"lora": {"target_modules": "all-linear"}},
    "async": {"rollout": {"max_staleness": 1}},
    "async_fixed_lag": {"rollout": {"max_staleness": 1, "version_policy": "fixed_lag"}},
}
def _example(task: str):
    """examples/<task>/build_dataset.py as a module (each recipe's is named build_dataset: loaded by path)."""
    path = ROOT / "examples" / task / "build_dataset.py"
    spec = importlib.util.spec_from_file_location(f"examples_{task}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def capitals_rows() -> tuple[list[dict], list[dict]]:
    capitals = _example("capitals")
    return capitals.rows(capitals.CAPITALS[:-capitals.TEST]), capitals.rows(capitals.CAPITALS[-capitals.TEST:])


def arithmetic_rows() -> tuple[list[dict], list[dict]]:
    """Two-digit sums from a fixed seed, the last 20 held out: examples/arithmetic's rows."""
    return _example("arithmetic").rows()


def reward(task: str) -> dict:
    """The task's reward: its recipe's (examples/<task>/job.yaml)."""
    return yaml.safe_load((ROOT / "examples" / task / "job.yaml").read_text())["method"]["cispo"]["reward"]


TASKS = {"capitals": capitals_rows, "arithmetic": arithmetic_rows}
PEERS = ("trl",)  # configs trained by another trainer (TRL's GRPOTrainer), evaluated by ours
# What TRL is told (trl_config): the shared settings in its names; TRL's defaults for the rest.
TRL_SHARED = {"per_device_train_batch_size": 16, "steps_per_generation": 2, "num_generations": 4,
              "learning_rate": 2e-4, "bf16": False, "loss_type": "cispo"}
TRL_BOOKKEEPING = {"report_to": "none", "save_strategy": "no", "gradient_checkpointing": False,
                   "dataloader_num_workers": 0}


def normalized(text: str) -> str:
    return text.translate(str.maketrans("", "", string.punctuation)).strip().casefold()


def merged(base: dict, sections: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for name, values in sections.items():
        out[name] = {**out.get(name, {}), **values}
    return out


def job(model: Path, task: str, config: str, seed: int, steps: int, eval_every: int, data: Path,
        max_output_tokens: int | None = None) -> dict:
    train_rows, test_rows = TASKS[task]()
    for name, part in (("train.jsonl", train_rows), ("test.jsonl", test_rows)):
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    raw = merged(SHARED, CONFIGS[config])
    raw["training"] = {**raw["training"], "steps": steps, "eval_interval": eval_every}
    if max_output_tokens is not None and "max_output_tokens" not in raw.get("sampling", {}):
        raw["sampling"] = {**raw.get("sampling", {}), "max_output_tokens": max_output_tokens}
    return {"model": str(model), "seed": seed, "reward": reward(task),
            "data": {"train_file": str(data / "train.jsonl"), "validation_file": str(data / "test.jsonl")}, **raw}


def learning_run(model: Path, task: str, config: str, seed: int, steps: int, eval_every: int,
                 max_output_tokens: int | None = None) -> dict:
    from service.job_spec.spec import JobSpec
    from worker.trainer.callbacks import NoCallbacks
    from worker.trainer.loop import Trainer

    steps_seen, evals = [], []

    class Collect(NoCallbacks):
        def on_step(self, step, metrics):
            steps_seen.append({"step": step, **{k: round(metrics[k], 4) for k in (
                "reward_mean", "zero_advantage_group_fraction", "truncated_fraction", "completion_length_mean",
                "kl_old", "clip_fraction", "entropy", "cispo_clip_ratio") if k in metrics}})

        def on_eval(self, step, metrics):
            evals[-1].update(step=step, reward=round(metrics["eval_reward_mean"], 4),
                             length=round(metrics["eval_completion_length"], 1))

    with tempfile.TemporaryDirectory(prefix="real-learning-") as tmp:
        tmp = Path(tmp)
        ours = "defaults" if config in PEERS else config  # a peer's job: the evaluation's rows, reward, lengths
        spec = JobSpec.model_validate(job(model, task, ours, seed, steps, eval_every, tmp, max_output_tokens))
        cpu, wall = time.process_time(), time.perf_counter()
        trainer = Trainer(spec, tmp / "run")
        plain_eval_rows = trainer.eval_rows

        def eval_rows(rows, *, first=0):  # the exact match of each evaluation, from its completions
            every = plain_eval_rows(rows, first=first)
            hits = sum(normalized(c) == normalized(r["answer"]) for c, r in zip(every.completions, rows))
            evals.append({"exact": hits / len(rows), "sample": every.completions[:2]})
            return every

        trainer.eval_rows = eval_rows
        if config == "trl":
            trained_by = trl_run(trainer, tmp / "trl", Collect())
        else:
            trainer.run(Collect())
            trained_by = "ours"
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    first, last = evals[0], evals[-1]
    return {"task": task, "config": config, "trainer": trained_by, "seed": seed, "steps": steps,
            "max_output_tokens": spec.sampling.max_output_tokens,
            "eval_before": first["reward"], "eval_after": last["reward"],
            "exact_before": first["exact"], "exact_after": last["exact"],
            "curve": [(e["step"], e["reward"], e["exact"]) for e in evals], "last_samples": last["sample"],
            "zero_group_fraction": statistics.fmean(s["zero_advantage_group_fraction"] for s in steps_seen),
            "truncated_fraction": statistics.fmean(s["truncated_fraction"] for s in steps_seen),
            "train_reward_first": steps_seen[0]["reward_mean"], "train_reward_last": steps_seen[-1]["reward_mean"],
            "per_step": steps_seen, "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
            "load": [round(x, 2) for x in os.getloadavg()], "threads": __import__("torch").get_num_threads()}


def trl_config(spec, out: Path) -> dict:
    """GRPOConfig's arguments for a job's shared settings: TRL_SHARED, the job's steps, length and seed."""
    import torch

    tc = spec.training
    assert (tc.batch_size * tc.group_size, tc.group_size, tc.mini_batches) == (
        TRL_SHARED["per_device_train_batch_size"] * TRL_SHARED["steps_per_generation"],
        TRL_SHARED["num_generations"], TRL_SHARED["steps_per_generation"]), "TRL_SHARED is not the job's shape"
    assert spec.optimizer.lr == TRL_SHARED["learning_rate"] and spec.dtype in ("float32", "auto")
    return {**TRL_SHARED, **TRL_BOOKKEEPING, "output_dir": str(out), "use_cpu": not torch.cuda.is_available(),
            "max_steps": tc.steps * tc.mini_batches, "logging_steps": tc.mini_batches,  # one log a rollout
            "max_completion_length": spec.sampling.max_output_tokens, "seed": spec.seed}


def trl_rows(rows: list[dict]) -> list[dict]:
    """Task rows as a TRL conversational dataset: the messages as its `prompt`, every other column kept."""
    return [{"prompt": r["messages"], **{k: v for k, v in r.items() if k != "messages"}} for r in rows]


def trl_reward(scorer, columns: list[str], failure_score: float):
    """A TRL reward function scoring with our scorer: each completion's text against its row (prompt + columns)."""
    def reward(prompts, completions, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rows = [{"messages": p, **{k: kwargs[k][i] for k in columns}} for i, p in enumerate(prompts)]
        return scorer.score(texts, rows, failure_score=failure_score).rewards.tolist()

    return reward


TRL_STEP = {"reward": "reward_mean", "frac_reward_zero_std": "zero_advantage_group_fraction",
            "completions/clipped_ratio": "truncated_fraction", "completions/mean_length": "completion_length_mean",
            "entropy": "entropy", "cispo_clip_ratio": "cispo_clip_ratio"}


def trl_metrics(logs: dict) -> dict:
    """One rollout's step metrics from TRL's log, in our metrics' names."""
    return {ours: logs[k] for k, ours in TRL_STEP.items() if logs.get(k) is not None}


def trl_run(trainer, out: Path, collect) -> str:
    """Train trainer.spec's job with TRL's GRPOTrainer(loss_type="cispo"), evaluated by `trainer` (its policy's
    model swapped for TRL's) at step 0 and every eval_interval rollouts, reported to `collect` as ours are."""
    import dataclasses

    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    spec, tc = trainer.spec, trainer.spec.training
    per_rollout = tc.mini_batches

    def evaluate(step: int) -> None:
        model = trainer.policy.model
        training = model.training
        model.eval()
        trainer.step = step
        try:
            collect.on_eval(step, trainer.evaluate())
        finally:
            model.train(training)

    class Hooks(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **_):
            trained = {id(q) for group in optimizer.param_groups for q in group["params"]}
            assert trained and trained <= {id(q) for q in trainer.policy.model.parameters()}, \
                "the evaluated model is not the one TRL trains"
            evaluate(0)

        def on_step_end(self, args, state, control, **_):
            step = state.global_step // per_rollout
            if state.global_step % per_rollout == 0 and (step % tc.eval_interval == 0 or step == tc.steps):
                evaluate(step)

        def on_log(self, args, state, control, logs=None, **_):
            if logs and "reward" in logs:  # one log a rollout (logging_steps = steps_per_generation)
                collect.on_step(state.global_step // per_rollout, trl_metrics(logs))

    rows = trl_rows(trainer.train_rows)
    columns = [k for k in rows[0] if k != "prompt"]
    tokenizer = AutoTokenizer.from_pretrained(spec.model)
    lora = LoraConfig(r=spec.lora.r, lora_alpha=spec.lora.alpha, lora_dropout=spec.lora.dropout,
                      target_modules=spec.lora.target_modules, task_type="CAUSAL_LM")
    peer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(spec.model, dtype=torch.float32),
        reward_funcs=trl_reward(trainer.scorer, columns, tc.reward_failure_score),
        args=trl.GRPOConfig(**trl_config(spec, out)), processing_class=tokenizer, peft_config=lora,
        train_dataset=Dataset.from_list(rows), callbacks=[Hooks()])
    trainer.policy = dataclasses.replace(trainer.policy, model=peer.model)  # our evaluation, TRL's weights
    peer.train()
    return f"trl {trl.__version__}"


def summary(path: Path) -> str:
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines, groups = [], defaultdict(list)
    for r in runs:
        groups[(r["task"], r["config"], r["steps"], r.get("max_output_tokens"))].append(r)
        curve = " ".join(f"{s}:{rw:.2f}" for s, rw, _ in r["curve"])
        lines.append(f"{r['task']:10} {r['config']:20} seed {r['seed']} {r['steps']} steps "
                     f"{r.get('max_output_tokens')} tokens: eval {r['eval_before']:.3f}"
                     f" -> {r['eval_after']:.3f}, exact {r['exact_before']:.2f} -> {r['exact_after']:.2f}; "
                     f"curve {curve}; zero-var groups {r['zero_group_fraction']:.2f}, truncated "
                     f"{r['truncated_fraction']:.2f}; {r['cpu_s']:.0f} s CPU, load {r['load'][0]:.2f}")
    lines.append("mean over seeds:")
    for (task, config, steps, tokens), group in sorted(groups.items(), key=str):
        gain = statistics.fmean(r["eval_after"] - r["eval_before"] for r in group)
        exact = statistics.fmean(r["exact_after"] - r["exact_before"] for r in group)
        lines.append(f"{task:10} {config:20} {steps} steps, {tokens} tokens, seeds {[r['seed'] for r in group]}: eval gain "
                     f"{gain:+.3f}, exact gain {exact:+.2f}, {statistics.fmean(r['cpu_s'] for r in group):.0f} s "
                     "CPU a run")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "runs" / "SmolLM2-135M-Instruct")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--task", choices=sorted(TASKS), nargs="+", default=["capitals"])
    parser.add_argument("--configs", choices=sorted(CONFIGS) + list(PEERS), nargs="+",
                        default=["defaults", "group_std"], help="trl: TRL's GRPOTrainer, with TRL's own defaults")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-output-tokens", type=int, default=None,
                        help="sampling.max_output_tokens of every run but a config's own (default: the spec's)")
    parser.add_argument("--summary", type=Path, help="print the summary of a results file and exit")
    args = parser.parse_args()
    if args.summary:
        print(summary(args.summary))
        return
    import torch

    torch.set_num_threads(args.threads)
    for seed in args.seeds:
        for task in args.task:
            for config in args.configs:
                run = learning_run(args.model.resolve(), task, config, seed, args.steps, args.eval_every,
                                   args.max_output_tokens)
                with args.out.open("a") as f:
                    f.write(json.dumps(run) + "\n")
                print(json.dumps({k: v for k, v in run.items() if k != "per_step"}), flush=True)
    print(summary(args.out))


if __name__ == "__main__":
    main()
