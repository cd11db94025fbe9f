"""K toy LoRA jobs of one base trained together on one resident base vs the same jobs one after another.

    .venv/bin/python bench/multi_job.py                  # K = 1, 2, 4, 8, several minutes on 2 CPUs
    .venv/bin/python bench/multi_job.py --steps 6 --ks 1,4
    .venv/bin/python bench/multi_job.py --width 512 --layers 4   # a base whose matmuls weigh
    .venv/bin/python bench/multi_job.py --gpu            # a CUDA machine: Qwen2.5-0.5B shapes, K = 1, 4, < 8 min
    .venv/bin/python bench/multi_job.py --smoke          # the GPU mode's path at tiny shapes, anywhere, in seconds

GPU mode: bench/gpu_step.py's workload (a random model with Qwen2.5-0.5B body
shapes, bf16, 8 prompts x 8 completions, 32-token prompts; here 128 new
tokens, LoRA r=16 all-linear), each job its own seed; the shared jobs held as
a shared worker holds them (the base in the jobs' compute dtype on the GPU,
the update under autocast). The figure of merit is the steady-state
aggregate rate (wall time between step reports: no model load, compile
warm-up, job start or end), target >= 1.5x at K = 4; peak GPU
memory is printed beside RSS.

Each configuration runs in a fresh child process (its peak RSS is its own):
- sequential K: the K jobs one after another, each by today's trainer (worker/trainer/loop.py: its own base);
- shared K: the K jobs resident on one base, advanced by cycles (worker/multi/cycle.py).
The jobs differ in seed only (same shapes); each runs its pre-flight-free run of --steps steps with the step-0 and
final evaluation and the final checkpoint, as a job does. Printed: aggregate steps/s and sampled tokens/s, and the
ratios shared / sequential by wall time, by CPU time (steps per CPU-second: on a loaded, shared machine the
steadier figure, since waiting for a core costs wall time but no CPU time), and by steady-state CPU time per step
(between step reports: no model load, no job start or end), peak RSS against one job alone, with the load average
beside them. Each configuration runs --repeats times, the best kept.
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


def wide_model(toy_dir: Path, width: int, layers: int) -> Path:
    """The toy model's tokenizer and shape, `width` wide and `layers` deep, random weights (made once): a base
    whose matmuls, not the per-job bookkeeping, take the time."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    out = toy_dir.parent / f"{toy_dir.name}-wide-{width}x{layers}"
    if (out / "config.json").exists():
        return out
    config = AutoConfig.from_pretrained(toy_dir / "model")
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = width, 2 * width, layers
    config.num_attention_heads = config.num_key_value_heads = max(1, width // 32)
    config.head_dim = width // config.num_attention_heads
    torch.manual_seed(0)
    building = out.with_name(f"{out.name}.{os.getpid()}")
    LlamaForCausalLM(config).save_pretrained(building)
    AutoTokenizer.from_pretrained(toy_dir / "model").save_pretrained(building)
    building.rename(out)
    return out


def _spec(toy_dir: Path, seed: int, steps: int, model: Path | None = None):
    from service.job_spec.spec import JobSpec
    from worker.toy.__main__ import toy_spec

    raw = toy_spec(toy_dir)
    raw["seed"] = seed
    if model is not None:
        raw["model"] = str(model)
    raw["training"].update({"steps": steps, "batch_size": 8, "group_size": 4, "mini_batches": 1,
                            "micro_batch_size": 32, "eval_interval": 0, "eval_max_rows": 8, "checkpoint_interval": 0,
                            "preflight_groups": 0})
    return JobSpec.model_validate(raw)


def gpu_workloads():
    """--gpu's and --smoke's workloads (bench/gpu_step.py's shapes; fewer new tokens, so K = 4 one after another
    fits the 8 minutes)."""
    from dataclasses import replace

    from bench.gpu_step import GPU_WORKLOAD, SMOKE_WORKLOAD

    return {"gpu": replace(GPU_WORKLOAD, max_tokens=128), "smoke": SMOKE_WORKLOAD}


def _workload_spec(work: Path, workload: str, seed: int, steps: int):
    """A job of the GPU (or smoke) workload: bench/trl_compare.py's spec, `steps` steps, evaluations at the ends."""
    from bench.trl_compare import our_spec
    from service.job_spec.spec import JobSpec

    w = gpu_workloads()[workload]
    raw = our_spec(work / "model", work / "train.jsonl", w)
    raw["seed"] = seed
    raw["training"].update({"steps": steps, "eval_interval": 0, "eval_max_rows": 8, "checkpoint_interval": 0,
                            "preflight_groups": 0})
    return JobSpec.model_validate(raw)


def prepare_workload(work: Path, workload: str) -> None:
    """The random model and the prompts, made once, before any timing."""
    from bench.trl_compare import build_model, write_prompts

    w = gpu_workloads()[workload]
    if not (work / "model" / "config.json").exists():
        build_model(work / "model", w)
    write_prompts(work / "train.jsonl", w)


class _Count:
    def __init__(self, sequences: int):
        self.sequences, self.steps, self.tokens = sequences, 0, 0.0
        self.cpu_marks: list[float] = []  # process CPU time at each step's report
        self.wall_marks: list[float] = []  # and wall time (the GPU mode's measure)

    def on_step(self, step, metrics):
        self.steps += 1
        self.tokens += metrics["completion_length_mean"] * self.sequences
        self.cpu_marks.append(_cpu_seconds())
        self.wall_marks.append(time.perf_counter())

    def on_eval(self, step, metrics): pass
    def on_checkpoint(self, step, path): pass
    def should_stop(self): return False


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(mode: str, k: int, steps: int, toy_dir: Path, threads: int, width: int = 0, layers: int = 4,
          workload: str = "toy", work: Path | None = None) -> dict:
    """One configuration, in this (fresh) process."""
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.model import precision
    from worker.model.policy import pick_device
    from worker.multi.cycle import run_cycle, start_jobs
    from worker.multi.job import ResidentJob
    from worker.multi.lora import SharedBase
    from worker.trainer.loop import Trainer

    if workload == "toy":
        from worker.toy.task import reward

        model = wide_model(toy_dir, width, layers) if width else None
        specs = [_spec(toy_dir, seed, steps, model) for seed in range(k)]
    else:
        from bench.trl_compare import reward

        specs = [_workload_spec(work, workload, seed, steps) for seed in range(k)]
    counts = [_Count(s.training.batch_size * s.training.group_size) for s in specs]
    out = Path(tempfile.mkdtemp(prefix="multi-job-bench-"))
    started = time.perf_counter()  # imports done: both modes pay loading the model, the jobs' starts and ends
    cpu_started = _cpu_seconds()
    if mode == "sequential":
        for i, (spec, count) in enumerate(zip(specs, counts)):
            Trainer(spec, out / f"job-{i}", reward_fn=reward).run(count)
    else:  # as worker/multi/runner.py holds a base: on the device, in the jobs' compute dtype, updates autocast
        device = pick_device()
        precision.enable_fast_matmul(device)
        dtype = precision.compute_dtype(specs[0].dtype, specs[0].model, device)
        tok = AutoTokenizer.from_pretrained(specs[0].model)
        tok.padding_side = "left"
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        shared = SharedBase(AutoModelForCausalLM.from_pretrained(specs[0].model, dtype=dtype).to(device), slots=k)
        jobs = [ResidentJob(spec, out / f"job-{i}", shared, tok, device, name=f"job-{i}", reward_fn=reward,
                            callbacks=count) for i, (spec, count) in enumerate(zip(specs, counts))]
        if failures := start_jobs(shared, jobs, device=device):
            raise RuntimeError(f"jobs failed to start: {failures}")
        while live := [job for job in jobs if not job.done]:
            failures = run_cycle(shared, live, device=device, autocast=lambda: precision.autocast(device, dtype))
            if failures:
                raise RuntimeError(f"jobs failed: {failures}")
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu_started
    # Steady state: time between step reports, so neither the model load, the jobs' starts (adapter, step-0
    # evaluation, compile warm-up) nor their ends count: sequential, each job's steps 2..N; shared, the cycles
    # after the first.
    if mode == "sequential":
        steady = sum(c.cpu_marks[-1] - c.cpu_marks[0] for c in counts)
        steady_wall = sum(c.wall_marks[-1] - c.wall_marks[0] for c in counts)
    else:
        steady = max(c.cpu_marks[-1] for c in counts) - min(c.cpu_marks[0] for c in counts)
        steady_wall = max(c.wall_marks[-1] for c in counts) - min(c.wall_marks[0] for c in counts)
    job_steps = k * (steps - 1)
    return {"seconds": seconds, "cpu_seconds": cpu, "steady_cpu_per_step": steady / job_steps,
            "steady_wall_per_step": steady_wall / job_steps, "steps": sum(c.steps for c in counts),
            "tokens": sum(c.tokens for c in counts),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0,
            "load": os.getloadavg()[0]}


def _run(mode: str, k: int, args) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--k", str(k), "--steps", str(args.steps),
           "--toy-dir", str(args.toy_dir), "--threads", str(args.threads), "--width", str(args.width),
           "--layers", str(args.layers), "--workload", args.workload] + (["--work", str(args.work)] if args.work else [])
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
            "steady_cpu_per_step": min(r["steady_cpu_per_step"] for r in runs),
            "steady_wall_per_step": min(r["steady_wall_per_step"] for r in runs),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "peak_gpu_mb": max(r["peak_gpu_mb"] for r in runs),
            "load": sum(r["load"] for r in runs) / len(runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default=None, help="default 1,2,4,8 (--gpu: 1,4; --smoke: 1,2)")
    parser.add_argument("--steps", type=int, default=None, help="steps a job (default 8; --gpu 4; --smoke 2)")
    parser.add_argument("--gpu", action="store_true", help="Qwen2.5-0.5B shapes on a CUDA device (see above)")
    parser.add_argument("--smoke", action="store_true", help="the GPU mode at tiny shapes, on any device")
    parser.add_argument("--workload", choices=["toy", "gpu", "smoke"], default="toy", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=0, help="a random base this wide instead of the toy model "
                        "(64 wide, 2 layers), so that its matmuls weigh as a real base's do")
    parser.add_argument("--layers", type=int, default=4, help="with --width: its depth")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, the best kept")
    parser.add_argument("--toy-dir", type=Path, default=None)
    parser.add_argument("--child", choices=["sequential", "shared"])
    parser.add_argument("--k", type=int)
    args = parser.parse_args()
    if args.child is None:
        if args.gpu or args.smoke:
            args.workload = "smoke" if args.smoke else "gpu"
            if args.gpu and not torch_cuda():
                sys.exit("no CUDA device: run --smoke here, or the toy modes")
            args.work = Path(tempfile.mkdtemp(prefix="multi-job-work-"))
            prepare_workload(args.work, args.workload)
            args.repeats = 1  # GPU time is dear, and a device is not shared the way these CPUs are
        defaults = {"toy": ("1,2,4,8", 8), "gpu": ("1,4", 4), "smoke": ("1,2", 2)}[args.workload]
        args.ks = args.ks or defaults[0]
        args.steps = args.steps or defaults[1]
    if args.toy_dir is None:
        from worker.toy.__main__ import prepare

        args.toy_dir = Path(os.environ.get("CISPO_TEST_TOY_DIR") or tempfile.mkdtemp(prefix="toy-"))
        if not (args.toy_dir / "spec.yaml").exists():
            prepare(args.toy_dir)
    if args.child:
        print(json.dumps(child(args.child, args.k, args.steps, args.toy_dir, args.threads, args.width, args.layers,
                               args.workload, args.work)))
        return
    if args.workload != "toy":
        gpu_main(args)
        return
    ks = [int(k) for k in args.ks.split(",")]
    if args.width:
        wide_model(args.toy_dir, args.width, args.layers)  # made once, before any timing
    one = _best("sequential", 1, args)  # one job alone: the memory reference
    base = f"random base {args.width} wide, {args.layers} layers" if args.width else "the toy base (64 wide, 2 layers)"
    print(f"{base}; {args.steps} steps a job, batch 8 x group 4, {args.threads} thread(s), best of {args.repeats}; one job "
          f"alone: {one['steps'] / one['seconds']:.2f} steps/s, peak RSS {one['peak_rss_mb']:.0f} MB "
          f"(load {one['load']:.2f})")
    print("| K | sequential steps/s | shared steps/s | wall x | shared tokens/s | tokens x | CPU-time x "
          "| steady CPU ms/step seq / shared | steady x | shared peak RSS MB | vs one job | load seq / shared |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k in ks:
        seq = one if k == 1 else _best("sequential", k, args)
        sh = _best("shared", k, args)
        seq_rate, sh_rate = seq["steps"] / seq["seconds"], sh["steps"] / sh["seconds"]
        seq_tok, sh_tok = seq["tokens"] / seq["seconds"], sh["tokens"] / sh["seconds"]
        cpu_x = (sh["steps"] / sh["cpu_seconds"]) / (seq["steps"] / seq["cpu_seconds"])
        print(f"| {k} | {seq_rate:.2f} | {sh_rate:.2f} | {sh_rate / seq_rate:.2f}x | {sh_tok:.0f} | "
              f"{sh_tok / seq_tok:.2f}x | {cpu_x:.2f}x | {1000 * seq['steady_cpu_per_step']:.0f} / "
              f"{1000 * sh['steady_cpu_per_step']:.0f} | {seq['steady_cpu_per_step'] / sh['steady_cpu_per_step']:.2f}x | "
              f"{sh['peak_rss_mb']:.0f} | "
              f"{sh['peak_rss_mb'] / one['peak_rss_mb']:.2f}x | {seq['load']:.1f} / {sh['load']:.1f} |", flush=True)



GPU_TARGET = 1.5  # K = 4 on one base, steady aggregate rate over one after another


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def gpu_main(args) -> None:
    """--gpu / --smoke: steady wall-time rates (a GPU's figure), peak GPU memory, the K = 4 target."""
    import torch

    started = time.perf_counter()
    w = gpu_workloads()[args.workload]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device: {device}; torch {torch.__version__}; workload {args.workload}: hidden {w.hidden}, "
          f"{w.layers} layers, vocab {w.vocab}, {w.dtype}, {w.batch} prompts x {w.group} completions, {w.max_tokens} new tokens, LoRA "
          f"r={w.lora_r}; {args.steps} steps a job (the first left out of the steady rate)")
    one = _best("sequential", 1, args)
    print("| K | sequential steady s/step | shared steady s/step | steady x | wall x | shared tokens/s | "
          "peak GPU MB seq / shared | peak RSS MB seq / shared | load |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios = {}
    for k in [int(k) for k in args.ks.split(",")]:
        seq = one if k == 1 else _best("sequential", k, args)
        sh = _best("shared", k, args)
        ratios[k] = seq["steady_wall_per_step"] / sh["steady_wall_per_step"]
        wall_x = (sh["steps"] / sh["seconds"]) / (seq["steps"] / seq["seconds"])
        print(f"| {k} | {seq['steady_wall_per_step']:.3f} | {sh['steady_wall_per_step']:.3f} | {ratios[k]:.2f}x | "
              f"{wall_x:.2f}x | {sh['tokens'] / sh['seconds']:.0f} | {seq['peak_gpu_mb']:.0f} / "
              f"{sh['peak_gpu_mb']:.0f} | {seq['peak_rss_mb']:.0f} / {sh['peak_rss_mb']:.0f} | "
              f"{seq['load']:.1f} / {sh['load']:.1f} |", flush=True)
    print(f"\n== summary ({time.perf_counter() - started:.0f} s) ==")
    for k, ratio in ratios.items():
        target = f"  (target >= {GPU_TARGET}x)" if k == 4 else ""
        print(f"K={k} shared vs sequential steady rate {ratio:.2f}x{target}")


if __name__ == "__main__":
    main()
