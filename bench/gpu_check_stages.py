"""The stages of bench/gpu_check.py, one per process: `python bench/gpu_check_stages.py STAGE --out DIR [--smoke]`.

Each prints as it goes and writes its figures to DIR/STAGE.json after every measurement, so a stage killed at
its timeout still leaves what it had measured. A failed check raises (non-zero exit) after its figures are saved.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


class Figures(dict):
    """A stage's figures, saved to its JSON file at every update."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        print(f"{key}: {value}", flush=True)
        self.path.write_text(json.dumps(self, indent=2, default=str))


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def stage_env(fig: Figures, smoke: bool) -> None:
    import transformers

    fig["python"] = platform.python_version()
    fig["torch"] = torch.__version__
    fig["cuda"] = torch.version.cuda
    fig["transformers"] = transformers.__version__
    for name in ("peft", "trl", "triton", "vllm"):
        try:
            fig[name] = __import__(name).__version__
        except ImportError:
            fig[name] = None
    fig["c_compiler"] = shutil.which("cc") or shutil.which("gcc")
    if CUDA:
        props = torch.cuda.get_device_properties(0)
        fig["device"] = f"{props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs"
        fig["bf16"] = torch.cuda.is_bf16_supported()
        fig["devices"] = torch.cuda.device_count()
    else:
        fig["device"] = "CPU"
    if CUDA and not fig["c_compiler"]:
        raise SystemExit("no C compiler: Triton (torch.compile) cannot build its kernels' launchers")


def _workload(smoke: bool):
    from bench.gpu_step import GPU_WORKLOAD, SMOKE_WORKLOAD

    return SMOKE_WORKLOAD if smoke else GPU_WORKLOAD


def _prompts(n: int, w) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(4, w.vocab, (w.prompt_tokens,), generator=gen).tolist() for _ in range(n)]


def _decode_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": int(sum(v for k, v in counters["inductor"].items() if "cudagraph_skip" in k)),
            "unique_graphs": int(counters["stats"]["unique_graphs"])}


def stage_decode(fig: Figures, smoke: bool) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bench.trl_compare import build_model
    from service.job_spec.sampling import SamplingSpec
    from worker.rollout import decode, static_decode
    from worker.rollout.effective_weights import rollout_weights

    w = _workload(smoke)
    if not CUDA:  # no CUDA graphs or Inductor here: the same compiled code path through aot_eager
        aot_step = torch.compile(static_decode.decode_step, backend="aot_eager", fullgraph=True)
        static_decode.compiled_step = lambda model: aot_step
    rows = w.batch * w.group
    prompts = _prompts(rows, w)
    new = min(32, w.max_tokens)
    sampling = SamplingSpec(max_output_tokens=w.max_tokens, max_model_len=w.prompt_tokens + w.max_tokens + 1)

    def run(model, batch, *, compiled, greedy=True, max_new=new):
        return decode.sample_tokens(model, batch, max_new=max_new, sampling=sampling, greedy=greedy, eos_id=-1,
                                    pad_id=0, device=DEVICE, compiled=compiled)[0]

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", w)
        # Equality on a 4-layer cut of the model (compiling is per layer: 24 layers cost ~30 s a shape).
        short_dir = build_model(Path(tmp) / "short", replace(w, layers=min(w.layers, 4)))
        # Token equality in float32 at full matmul precision: bf16 rounding differs between fused and eager
        # kernels, and a random model's near-ties then flip argmaxes without anything being wrong.
        torch.set_float32_matmul_precision("highest")
        model = AutoModelForCausalLM.from_pretrained(short_dir, dtype=torch.float32).to(DEVICE).eval()
        torch._dynamo.utils.counters.clear()
        for label, lora in (("plain", False), ("lora", True)):
            target = model
            if lora:
                target = get_peft_model(model, LoraConfig(r=w.lora_r, lora_alpha=2 * w.lora_r,
                                                          target_modules="all-linear"))
                with torch.no_grad():
                    for name, p in target.named_parameters():
                        if "lora_B" in name:
                            p.normal_(0, 0.05)
                target.eval()
            with rollout_weights(target) as generator:
                eager, compiled = run(generator, prompts, compiled=False), run(generator, prompts, compiled=True)
            fig[f"greedy_equal_rows_{label}"] = f"{sum(a == b for a, b in zip(eager, compiled))}/{rows}"
            fig[f"greedy_equal_{label}"] = eager == compiled
        del target, model
        gc.collect()
        for key, value in _decode_counters().items():
            fig[f"fp32_{key}"] = value

        # The bench shape in its own dtype: recompiles across batch sizes, ms per step compiled vs eager.
        torch.set_float32_matmul_precision("high")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, w.dtype)).to(DEVICE).eval()
        graphs = []
        for batch in (rows, 13 if rows > 13 else max(rows - 1, 1), rows):
            run(model, prompts[:batch], compiled=True, greedy=False)
            graphs.append(_decode_counters()["unique_graphs"])
        fig["graphs_after_64_13_64"] = graphs
        fig["recompiles_on_return_to_64"] = graphs[2] - graphs[1]
        for label, compiled, repeats, steps in (("compiled", True, 1 if smoke else 3, w.max_tokens),
                                                ("eager", False, 1, min(w.max_tokens, 64))):  # eager: ~23 ms/step
            run(model, prompts, compiled=compiled, greedy=False, max_new=steps)  # warm
            seconds = []
            for _ in range(repeats):
                _sync()
                started = time.perf_counter()
                run(model, prompts, compiled=compiled, greedy=False, max_new=steps)
                _sync()
                seconds.append(time.perf_counter() - started)
            fig[f"ms_per_step_{label}"] = round(statistics.median(seconds) / steps * 1e3, 3)
    counts = _decode_counters()
    fig["graph_breaks"], fig["cudagraph_skips"] = counts["graph_breaks"], counts["cudagraph_skips"]
    fig["compile_fallbacks"] = static_decode.take_compile_fallbacks()
    problems = [k for k in ("graph_breaks", "cudagraph_skips", "recompiles_on_return_to_64") if fig[k]]
    problems += ["compile_fallbacks"] if fig["compile_fallbacks"] else []
    if problems:
        raise SystemExit(f"decode check failed: {problems}")


class _Recorder:
    def __init__(self):
        self.steps, self.evals = [], []

    def on_step(self, step, metrics):
        self.steps.append(metrics)

    def on_eval(self, step, metrics):
        self.evals.append(metrics)

    def on_checkpoint(self, step, path):
        pass

    def should_stop(self):
        return False


def stage_train(fig: Figures, smoke: bool) -> None:
    from service.job_spec.spec import JobSpec
    from worker.toy.__main__ import prepare, toy_spec
    from worker.trainer.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare(root / "toy")
        for mode in ("lora", "full"):
            raw = toy_spec(root / "toy")
            raw["dtype"] = "bfloat16"
            raw["lora"] = raw["lora"] if mode == "lora" else None
            raw["training"].update(steps=2, batch_size=4, group_size=4, mini_batches=2, micro_batch_size=8,
                                   eval_interval=2, eval_max_rows=5, checkpoint_interval=0)  # eval: 5 rows, not 16
            spec = JobSpec.model_validate(raw)
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            recorder = _Recorder()
            started = time.perf_counter()
            train(spec, root / f"run-{mode}", callbacks=recorder, resume=False)
            fig[f"{mode}_seconds"] = round(time.perf_counter() - started, 1)
            losses = [m["loss"] for m in recorder.steps]
            fig[f"{mode}_losses"] = losses
            fig[f"{mode}_evals"] = len(recorder.evals)
            fig[f"{mode}_decode_compile_fallbacks"] = sum(m.get("decode_compile_fallbacks", 0) for m in recorder.steps)
            gc.collect()
            if CUDA:
                fig[f"{mode}_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
                fig[f"{mode}_retained_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
            if len(losses) != 2 or not all(math.isfinite(x) for x in losses) or not recorder.evals:
                raise SystemExit(f"{mode}: expected 2 finite losses and an evaluation, got {losses}, "
                                 f"{len(recorder.evals)} evaluations")


def stage_bench(fig: Figures, smoke: bool) -> None:
    import subprocess

    command = [sys.executable, "-u", str(ROOT / "bench" / "gpu_step.py")]
    # the max_staleness row is gpu_step.py's own run: it would not fit this stage's budget
    command += ["--no-async"] + (["--smoke"] if smoke else ["--steps", "2", "--warmup", "1"])
    proc = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(proc.stdout, flush=True)
    summary = proc.stdout.split("== summary")[-1]
    for line in summary.splitlines():
        words = line.split()
        if len(words) > 5 and words[1:5] == ["step", "speed-up", "vs", "TRL"]:
            fig[f"{words[0]}_speedup_vs_trl"] = float(words[5].rstrip("x"))
        elif words[:1] == ["decode"] and len(words) > 1:
            fig["decode_ms_per_step"] = float(words[1])
    if proc.returncode != 0:
        raise SystemExit(f"bench/gpu_step.py exited {proc.returncode}")


STAGES = {"env": stage_env, "decode": stage_decode, "train": stage_train, "bench": stage_bench}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=list(STAGES))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    STAGES[args.stage](Figures(args.out / f"{args.stage}.json"), args.smoke)


if __name__ == "__main__":
    main()
