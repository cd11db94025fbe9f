"""One CISPO step, ours against TRL's, on a GPU: LoRA and full fine-tuning, and our decode ms/step.

    .venv/bin/python bench/gpu_step.py            # a CUDA machine: under 8 minutes on one H200
    .venv/bin/python bench/gpu_step.py --smoke    # anywhere, in seconds: tiny shapes, one step each

Needs the bench extra (`pip install -e .[worker,bench]`). The workload is the
one in /work/shared/research/gpu_baselines.md: a random model with
Qwen2.5-0.5B body shapes (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, tied embeddings, 32k vocabulary), bf16, 8 prompts x 8
completions, 32-token prompts, 256 new tokens, temperature 1. Both sides run
interleaved in one process (bench/trl_compare.py's side_by_side), warm-up
steps dropped (ours compiles its decode step there), medians printed.

Decode ms/step times our sampler alone (worker/rollout/decode.py) on the same
64 prompts: on CUDA the static-cache decode step compiled with CUDA graphs,
elsewhere the eager loop (the script says which one ran, and whether
compiling fell back). Targets: LoRA >= 8x TRL, full >= 4x,
decode <= 2.7 ms/step. Last, our LoRA step at rollout.max_staleness 1 against
0 (bench/async_step.py's measurement: the sampler process shares the GPU;
target: >= 1.5x).
"""

from __future__ import annotations

import argparse
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

from bench.trl_compare import Workload, build_model, print_side_by_side, side_by_side  # noqa: E402

GPU_WORKLOAD = Workload(batch=8, group=8, prompt_tokens=32, max_tokens=256, vocab=32000, hidden=896,
                        intermediate=4864, layers=24, heads=14, kv_heads=2, tie_embeddings=True, lora_r=16,
                        dtype="bfloat16")
SMOKE_WORKLOAD = Workload(batch=2, group=2, prompt_tokens=8, max_tokens=8, vocab=256, hidden=32, intermediate=64,
                          layers=2, heads=2, kv_heads=1, lora_r=4, dtype="float32")
TARGETS = {"lora": 8.0, "full": 4.0}
DECODE_TARGET_MS = 2.7
ASYNC_TARGET = 1.5


def decode_ms_per_step(w: Workload, workdir: Path, *, repeats: int) -> tuple[float, str]:
    """Median ms per decode step of our sampler on the workload's prompts, and which loop ran."""
    from transformers import AutoModelForCausalLM

    from service.job_spec.sampling import SamplingSpec
    from worker.rollout import decode, static_decode

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = build_model(workdir / "decode-model", w)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, w.dtype)).to(device).eval()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, w.vocab, (w.prompt_tokens,), generator=gen).tolist()
               for _ in range(w.batch * w.group)]
    sampling = SamplingSpec(max_output_tokens=w.max_tokens, max_model_len=w.prompt_tokens + w.max_tokens + 1)
    compiled = device.type == "cuda"
    kwargs = dict(max_new=w.max_tokens, sampling=sampling, greedy=False, eos_id=-1, pad_id=0, device=device,
                  compiled=compiled)  # eos_id -1: every row runs all max_tokens steps
    decode.sample_tokens(model, prompts, **kwargs)  # warm-up (and compile)
    fallbacks = static_decode.take_compile_fallbacks()
    seconds = []
    for _ in range(repeats):
        if compiled:
            torch.cuda.synchronize()
        started = time.perf_counter()
        decode.sample_tokens(model, prompts, **kwargs)
        if compiled:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    fallbacks += static_decode.take_compile_fallbacks()
    loop = "eager" if not compiled else (f"eager (compiling failed: {fallbacks[0]})" if fallbacks else
                                         "static cache, torch.compile reduce-overhead (CUDA graphs)")
    return statistics.median(seconds) / w.max_tokens * 1e3, loop


def async_speedup(w: Workload, workdir: Path, *, steps: int, warmup: int) -> float:
    """Our LoRA step's rate at rollout.max_staleness 1 over 0, each a whole Trainer.run (bench/async_step.py)."""
    from bench.async_step import measure, report
    from bench.trl_compare import our_spec, reward, write_prompts

    model = build_model(workdir / "model", w)
    write_prompts(workdir / "train.jsonl", w)
    raw = our_spec(model, workdir / "train.jsonl", w)
    warmup = max(1, warmup)  # the first step's end is where measuring starts
    runs = [measure(raw, s, steps=steps, warmup=warmup, out=workdir / f"s{s}", reward_fn=reward) for s in (0, 1)]
    return report("async", f"LoRA r={w.lora_r}, max_staleness 0 and 1", runs, warmup)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and one step each: checks the script runs")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per side and mode")
    parser.add_argument("--warmup", type=int, default=1, help="steps per side left out (our compile happens here)")
    parser.add_argument("--no-async", action="store_true",
                        help="skip the max_staleness row (bench/gpu_check.py's bench stage: its time budget)")
    args = parser.parse_args()
    w, steps, warmup = (SMOKE_WORKLOAD, 1, 0) if args.smoke else (GPU_WORKLOAD, args.steps, args.warmup)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke, or bench/trl_compare.py for the CPU comparison")
    started = time.perf_counter()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device: {device}; torch {torch.__version__}")
    speedups = {}
    for mode, lora_r in (("lora", w.lora_r), ("full", 0)):
        with tempfile.TemporaryDirectory() as tmp:
            print(f"\n== {mode} ==")
            result = side_by_side(replace(w, lora_r=lora_r), steps=steps, warmup=warmup, workdir=Path(tmp))
            speedups[mode] = print_side_by_side(result)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        ms, loop = decode_ms_per_step(w, Path(tmp), repeats=1 if args.smoke else 3)
    overlap = None
    if not args.no_async:
        with tempfile.TemporaryDirectory() as tmp:
            overlap = async_speedup(w, Path(tmp), steps=steps, warmup=warmup)
    print(f"\n== summary ({time.perf_counter() - started:.0f} s) ==")
    for mode, target in TARGETS.items():
        print(f"{mode:<6} step speed-up vs TRL {speedups[mode]:6.2f}x  (target >= {target:.0f}x)")
    print(f"decode {ms:.2f} ms/step for {w.batch * w.group} sequences, {loop}  (target <= {DECODE_TARGET_MS} ms)")
    if overlap is not None:
        print(f"async  max_staleness 1 vs 0   {overlap:6.2f}x  (target >= {ASYNC_TARGET}x)")


if __name__ == "__main__":
    main()
