"""Our CISPO step against TRL's GRPOTrainer(loss_type="cispo"), side by side in one process.

    .venv/bin/python bench/trl_compare.py --threads 1             # ~3 min on 2 busy CPU cores
    .venv/bin/python bench/trl_compare.py --steps 3 --warmup 1    # quicker, noisier
    .venv/bin/python bench/trl_compare.py --shape qwen2.5-0.5b --steps 2 --warmup 1   # ~10 min on 2 busy cores

Needs the bench extra (`pip install -e .[worker,bench]`, which brings `trl`).

Both sides get the same workload: one random-init Llama built here and loaded
with from_pretrained from a local directory (a random model almost never
samples EOS, so nearly every completion runs the full max_tokens: the worst
case), the same prompts, batch x group, max new tokens, LoRA config, sampling
settings (temperature 1, no top-k/top-p), AdamW settings, mean-only group
advantages, and one optimizer step per rollout batch over all sequences in
one micro-batch (TRL's default shape; CISPO's ratio is then exactly 1 on both
sides). TRL runs without gradient checkpointing and in the same dtype as ours.

Steps are interleaved: a TRL callback times each TRL step (on_step_begin to
on_step_end) and then runs and times one step of ours, so both see the same
machine load. Warm-up steps are dropped; the medians of the rest are printed,
with the generation share of each side and the ratio TRL / ours (> 1: we are faster).
bench/gpu_step.py reuses these pieces on a GPU.

Beside the ratio it prints each phase against its floor on this machine
(bench/floors.py: memory bandwidth and matmul rate measured here, in the
same thread setting): our rollout against its decode floor, our update
against its FLOPs, and each side's peak RSS, measured in a child process of
its own (`--rss-steps` steps of that side alone, since the interleaved run
holds both models) against base weights + adapter + optimizer state +
activations + KV cache. The load average is printed beside the figures: on
a shared machine the wall times move with it, the CPU-time ratio less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


@dataclass(frozen=True)
class Workload:
    batch: int = 4  # prompts per step
    group: int = 4  # completions per prompt
    prompt_tokens: int = 32
    max_tokens: int = 64  # new tokens per completion
    vocab: int = 8192
    hidden: int = 384
    intermediate: int = 1024
    layers: int = 4
    heads: int = 6
    kv_heads: int = 2
    tie_embeddings: bool = False
    lora_r: int = 16  # None: full fine-tuning
    dtype: str = "float32"  # both sides' model
    rollout_dtype: str = "auto"  # ours only: rollout.dtype (a lower one samples faster, with the TIS correction)

    def shape(self):
        from bench.floors import Shape

        return Shape(vocab=self.vocab, hidden=self.hidden, intermediate=self.intermediate, layers=self.layers,
                     heads=self.heads, kv_heads=self.kv_heads, tied=self.tie_embeddings)

    def step(self):
        from bench.floors import Step

        return Step(prompts=self.batch, group=self.group, prompt_tokens=self.prompt_tokens,
                    new_tokens=self.max_tokens, lora_r=self.lora_r or 0,
                    dtype_bytes=getattr(torch, self.dtype).itemsize)

    def describe(self, params: int) -> str:
        tuning = f"LoRA r={self.lora_r} all-linear" if self.lora_r else "full fine-tuning"
        rollout = "" if self.rollout_dtype == "auto" else f"; our rollouts in {self.rollout_dtype}"
        return (f"random Llama {params / 1e6:.2f}M params (hidden {self.hidden}, {self.layers} layers, vocab "
                f"{self.vocab}, {self.dtype}); {self.batch} prompts x {self.group} completions, "
                f"{self.prompt_tokens}-token prompts, {self.max_tokens} new tokens; {tuning}{rollout}")


# --shape: the small default (Python overhead dominates) and Qwen2.5-0.5B's body on a 32k vocabulary (random init)
SHAPES = {
    "small": {},
    "qwen2.5-0.5b": dict(vocab=32768, hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2,
                         tie_embeddings=True, prompt_tokens=16, max_tokens=32),
}


def build_model(out: Path, w: Workload) -> Path:
    """A random Llama and a word-level tokenizer of w.vocab words, saved for from_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = SPECIALS + [f"w{i}" for i in range(w.vocab - len(SPECIALS))]
    core = Tokenizer(models.WordLevel(vocab={word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=w.vocab, hidden_size=w.hidden, intermediate_size=w.intermediate, num_hidden_layers=w.layers,
        num_attention_heads=w.heads, num_key_value_heads=w.kv_heads, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=w.tie_embeddings,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = 0
    # Stored in the workload's dtype, as a hub checkpoint of a bf16 model is: both sides load it in that dtype, and
    # building bf16 weights from a float32 file maps the whole file beside them (a load-time peak neither side has
    # with a real bf16 checkpoint).
    model.to(getattr(torch, w.dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_prompts(path: Path, w: Workload) -> list[str]:
    gen = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(0, w.vocab - len(SPECIALS), (w.prompt_tokens,),
                                                             generator=gen))
               for _ in range(w.batch * 8)]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return prompts


def reward(completion: str, **_row) -> float:
    """Share of even-numbered words: cheap, and varied enough that no group has equal rewards."""
    words = completion.split()
    return sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(1, len(words))


def trl_reward(completions, **_kwargs) -> list[float]:
    return [reward(c) for c in completions]


def our_spec(model_dir: Path, data: Path, w: Workload) -> dict:
    """Our job spec of the workload (as JSON), with LoRA whatever w.lora_r says (our_trainer swaps it out)."""
    return {
        "model": str(model_dir), "dtype": w.dtype, "seed": 0,
        "data": {"train_file": str(data)},
        "reward": {"type": "import", "path": "bench.trl_compare:reward"},  # the same function, passed as reward_fn
        "lora": {"r": w.lora_r or 8, "alpha": 2 * (w.lora_r or 8), "target_modules": "all-linear"},
        "sampling": {"temperature": 1.0, "max_output_tokens": w.max_tokens,
                     "max_model_len": w.prompt_tokens + w.max_tokens + 8},
        "rollout": {"dtype": w.rollout_dtype},
        "optimizer": {"lr": 1e-5, "max_grad_norm": 1.0},
        "loss": {"ratio_max": 5.0},
        "training": {"steps": 10**6, "batch_size": w.batch, "group_size": w.group, "mini_batches": 1,
                     "micro_batch_size": w.batch * w.group},
    }


@contextmanager
def scratch_trainer(w: Workload):
    """Our Trainer on the workload's model and prompts, built in a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model(work / "model", w)
        write_prompts(work / "train.jsonl", w)
        yield our_trainer(work / "model", work / "train.jsonl", work / "ours", w)


def our_trainer(model_dir: Path, data: Path, out: Path, w: Workload):
    """Our Trainer on the workload; full fine-tuning swaps in the bare model where the spec cannot say `lora: null`."""
    from pydantic import ValidationError

    from service.job_spec.spec import JobSpec
    from worker.trainer.loop import Trainer

    raw = our_spec(model_dir, data, w)
    if not w.lora_r:
        try:
            return Trainer(JobSpec.model_validate({**raw, "lora": None}), out, reward_fn=reward, resume=False)
        except ValidationError:
            pass
    trainer = Trainer(JobSpec.model_validate(raw), out, reward_fn=reward, resume=False)
    if not w.lora_r:
        _train_all_weights(trainer)
    return trainer


def _train_all_weights(trainer) -> None:
    """Full fine-tuning where the spec is LoRA-only: the same trainer, policy and updater around the bare model."""
    from worker.model.policy import Policy
    from worker.trainer.update import Updater

    model = trainer.policy.model.unload()  # the base model without the (untrained) adapter layers
    model.requires_grad_(True)
    opt = trainer.spec.optimizer
    trainer.policy = Policy(model=model, tokenizer=trainer.policy.tokenizer, device=trainer.policy.device)
    trainer.optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                          weight_decay=opt.weight_decay)
    trainer.updater = Updater(trainer.policy, trainer.optimizer, trainer.spec)


def trl_trainer(model_dir: Path, prompts: list[str], out: Path, w: Workload, *, steps: int, callbacks):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    dtype = getattr(torch, w.dtype)
    config = GRPOConfig(
        output_dir=str(out), use_cpu=not torch.cuda.is_available(), bf16=dtype == torch.bfloat16, seed=0,
        report_to="none", save_strategy="no", logging_steps=10**6, max_steps=steps, gradient_checkpointing=False,
        per_device_train_batch_size=w.batch * w.group, gradient_accumulation_steps=1,
        num_generations=w.group, max_completion_length=w.max_tokens,
        temperature=1.0, top_p=1.0, top_k=0, loss_type="cispo", epsilon_high=5.0, beta=0.0, scale_rewards="none",
        learning_rate=1e-5, lr_scheduler_type="constant", optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.95,
        adam_epsilon=1e-15, weight_decay=0.0, max_grad_norm=1.0, dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    lora = LoraConfig(r=w.lora_r, lora_alpha=2 * w.lora_r, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM") if w.lora_r else None
    return GRPOTrainer(model=model, reward_funcs=trl_reward, args=config, processing_class=tokenizer,
                       train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), peft_config=lora,
                       callbacks=callbacks)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def side_by_side(w: Workload, *, steps: int, warmup: int, workdir: Path) -> dict:
    """Interleaved steps of TRL and ours on one workload; per side the kept step and generation times."""
    from transformers import TrainerCallback

    model_dir = build_model(workdir / "model", w)
    prompts = write_prompts(workdir / "train.jsonl", w)
    ours = our_trainer(model_dir, workdir / "train.jsonl", workdir / "ours", w)
    times: dict[str, list[float]] = {"trl": [], "trl_generate": [], "ours": [], "ours_rollout": [],
                                     "ours_update": [], "trl_cpu": [], "ours_cpu": [], "load": []}

    class Interleave(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            _sync()
            self.started, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, *_a, **_k):
            _sync()
            times["trl"].append(time.perf_counter() - self.started)
            times["trl_cpu"].append(time.process_time() - self.cpu)
            started, cpu = time.perf_counter(), time.process_time()
            metrics = ours.train_step()
            _sync()
            times["ours"].append(time.perf_counter() - started)
            times["ours_cpu"].append(time.process_time() - cpu)
            times["ours_rollout"].append(metrics["rollout_seconds"])
            times["ours_update"].append(metrics["update_seconds"])
            times["load"].append(os.getloadavg()[0])

    peer = trl_trainer(model_dir, prompts, workdir / "trl", w, steps=warmup + steps, callbacks=[Interleave()])
    generate = peer.model.generate

    def timed_generate(*a, **k):
        started = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            _sync()
            times["trl_generate"].append(time.perf_counter() - started)

    peer.model.generate = timed_generate
    peer.train()
    params = sum(p.numel() for p in ours.policy.model.parameters())
    result = {k: v[warmup:] for k, v in times.items()}
    result["workload"] = w.describe(params)
    del peer, ours
    return result


def print_side_by_side(result: dict) -> float:
    """Print the medians; return the speed-up (median TRL step / median our step)."""
    med = {k: statistics.median(v) for k, v in result.items() if isinstance(v, list)}
    print(f"workload: {result['workload']}; {len(result['ours'])} measured steps each")
    print(f"{'side':<6} {'median s/step':>14} {'min':>7} {'max':>7} {'generation':>11}")
    for side, gen in (("trl", "trl_generate"), ("ours", "ours_rollout")):
        print(f"{side:<6} {med[side]:14.3f} {min(result[side]):7.3f} {max(result[side]):7.3f} "
              f"{med[gen] / med[side]:10.0%}")
    speedup = med["trl"] / med["ours"]
    print(f"speed-up vs TRL (median TRL step / median our step): {speedup:.2f}x wall, "
          f"{med['trl_cpu'] / med['ours_cpu']:.2f}x CPU time (process CPU seconds: steadier on a busy machine)"
          + (f"; load average {min(result['load']):.1f}-{max(result['load']):.1f}" if result.get("load") else ""))
    return speedup


def measure_machine() -> dict:
    """Memory read bandwidth and float32 / bfloat16 matmul rates, in this process's thread setting."""
    from bench.floors import measure_bandwidth, measure_matmul_rate

    return {"bandwidth": measure_bandwidth(), "float32": measure_matmul_rate(torch.float32),
            "bfloat16": measure_matmul_rate(torch.bfloat16), "load": os.getloadavg()[0]}


def best_machine(*measured: dict) -> dict:
    """The best of each rate over the measurements (a floor is what the machine can do, not what it did once)."""
    return {k: max(m[k] for m in measured) for k in ("bandwidth", "float32", "bfloat16")}


def print_floors(result: dict, w: Workload, machine: dict, rss: dict[str, dict] | None = None) -> dict:
    """Our phases against their floors on this machine, and each side's peak RSS against the memory floor."""
    from bench.floors import decode_bytes, decode_flops, floor_seconds, memory_floor_bytes, update_flops

    shape, step = w.shape(), w.step()
    rate = machine[w.dtype]
    decode_floor = floor_seconds(decode_bytes(shape, step), decode_flops(shape, step), machine["bandwidth"], rate)
    update_floor = update_flops(shape, step) / rate
    med = {k: statistics.median(result[k]) for k in ("ours_rollout", "ours_update", "trl_generate")}
    print(f"machine: read bandwidth {machine['bandwidth'] / 1e9:.1f} GB/s, matmul float32 "
          f"{machine['float32'] / 1e9:.0f} GFLOP/s, bfloat16 {machine['bfloat16'] / 1e9:.0f} GFLOP/s")
    print(f"decode floor {decode_floor:.2f} s ({decode_bytes(shape, step) / 1e9:.2f} GB read / bandwidth, "
          f"{decode_flops(shape, step) / 1e9:.1f} GFLOP / {w.dtype} rate: the larger); "
          f"ours {med['ours_rollout']:.2f} s = {med['ours_rollout'] / decode_floor:.2f}x floor, "
          f"TRL generate {med['trl_generate']:.2f} s = {med['trl_generate'] / decode_floor:.2f}x")
    print(f"update floor {update_floor:.2f} s ({update_flops(shape, step) / 1e9:.1f} GFLOP / {w.dtype} rate); "
          f"ours {med['ours_update']:.2f} s = {med['ours_update'] / update_floor:.2f}x floor")
    parts = memory_floor_bytes(shape, step)
    print("memory floor " + " + ".join(f"{k} {v / 1e9:.2f}" for k, v in parts.items() if k != "sum")
          + f" = {parts['sum'] / 1e9:.2f} GB")
    for side, got in (rss or {}).items():
        print(f"peak RSS {side:<4} {got['peak'] / 1e9:.2f} GB = {got['peak'] / parts['sum']:.2f}x floor "
              f"(of which {got['baseline'] / 1e9:.2f} GB before the model: Python and libraries; "
              f"load {got['load']:.1f})")
    if rss and {"ours", "trl"} <= rss.keys():
        print(f"peak RSS ours / TRL: {rss['ours']['peak'] / rss['trl']['peak']:.2f}x")
    return {"decode_floor": decode_floor, "update_floor": update_floor, "memory_floor": parts["sum"]}


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def run_alone(side: str, w: Workload, workdir: Path, steps: int) -> dict:
    """`steps` steps of one side in this process (a child's): its peak RSS, and what it held before the model."""
    baseline = _status_bytes("VmRSS")
    phases: dict[str, float] = {}
    if side == "ours":
        trainer = our_trainer(workdir / "model", workdir / "train.jsonl", workdir / f"alone-ours-{os.getpid()}", w)
        for _ in range(steps):
            cpu = time.process_time()
            metrics = trainer.train_step()
            phases = {"step_cpu": time.process_time() - cpu,
                      **{k: metrics[k] for k in ("rollout_seconds", "update_seconds", "step_seconds")}}
    else:
        prompts = [json.loads(line)["prompt"] for line in (workdir / "train.jsonl").read_text().splitlines()]
        trl_trainer(workdir / "model", prompts, workdir / "alone-trl", w, steps=steps, callbacks=[]).train()
    # This memory's own high-water mark: getrusage's ru_maxrss survives fork + exec, so a child of the
    # side-by-side process (both models loaded) would report its parent's peak.
    peak = _status_bytes("VmHWM")
    return {"peak": peak, "baseline": baseline, "load": os.getloadavg()[0], **phases}


def peak_rss(side: str, argv: list[str], workdir: Path) -> dict:
    """run_alone in a child process (this one holds both sides' models)."""
    out = subprocess.run([sys.executable, __file__, *argv, "--alone", side, "--workdir", str(workdir)],
                         capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("ALONE ")]
    if out.returncode or not lines:
        raise RuntimeError(f"the {side} side alone failed: {out.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("ALONE "))


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload options every bench on this workload takes (see workload_from)."""
    parser.add_argument("--shape", default="small", choices=list(SHAPES), help="the model and prompt shapes")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per completion (default: the shape's)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default); 1 gives steadier figures on a busy shared machine")


def workload_from(args: argparse.Namespace, **overrides) -> Workload:
    """The Workload add_workload_args' options name (torch's thread count set as a side effect)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = dict(SHAPES[args.shape])
    if args.max_tokens is not None:
        shape["max_tokens"] = args.max_tokens
    return Workload(**{**shape, **overrides})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--steps", type=int, default=6, help="measured steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="steps per side left out of the figures")
    parser.add_argument("--batch", type=int, default=Workload.batch, help="prompts per step")
    parser.add_argument("--group", type=int, default=Workload.group, help="completions per prompt")
    parser.add_argument("--lora-r", type=int, default=Workload.lora_r, help="0: full fine-tuning")
    parser.add_argument("--dtype", default=Workload.dtype, choices=["float32", "bfloat16"], help="both sides' model")
    parser.add_argument("--rollout-dtype", default=Workload.rollout_dtype, choices=["auto", "float32", "bfloat16"],
                        help="our rollouts only (rollout.dtype)")
    parser.add_argument("--rss-steps", type=int, default=1,
                        help="steps of each side alone, in a child process, for its peak RSS (0: skip)")
    parser.add_argument("--alone", choices=["ours", "trl"],
                        help="only this side, --rss-steps steps: its peak RSS (and ours: its phases), as JSON")
    parser.add_argument("--workdir", type=Path,
                        help="with --alone: the directory holding model/ and train.jsonl (built there if missing)")
    args = parser.parse_args()
    w = workload_from(args, batch=args.batch, group=args.group, lora_r=args.lora_r, dtype=args.dtype,
                      rollout_dtype=args.rollout_dtype)
    if args.alone:
        if not (args.workdir / "model").exists():
            build_model(args.workdir / "model", w)
            write_prompts(args.workdir / "train.jsonl", w)
        print("ALONE " + json.dumps(run_alone(args.alone, w, args.workdir, args.rss_steps)), flush=True)
        return
    print(f"torch threads {torch.get_num_threads()}; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    before = measure_machine()
    with tempfile.TemporaryDirectory() as tmp:
        result = side_by_side(w, steps=args.steps, warmup=args.warmup, workdir=Path(tmp))
        after = measure_machine()
        child_argv = [a for a in sys.argv[1:]]
        rss = {side: peak_rss(side, child_argv, Path(tmp)) for side in ("ours", "trl")} if args.rss_steps else {}
    print_side_by_side(result)
    print(f"(machine measured at load {before['load']:.1f} and {after['load']:.1f}; the best of the two is used)")
    print_floors(result, w, best_machine(before, after), rss)


if __name__ == "__main__":
    main()
