"""Where each decode step of our rollout goes, by phase: ms per step for the base linears, the LoRA paths,
attention and its KV cache, the norms and MLP activation, the LM head, sampling and log-probs, and the
Python between operators.

    flock /tmp/bigmem.lock .venv/bin/python bench/decode_phases.py --shape qwen2.5-0.5b --threads 1

bench/decode_floor.py's workload and sampler (one warm-up call, then timed calls unprofiled), then one
call under torch.profiler with a label on every module call (forward hooks) and on the sampler's
picking: each operator (with its callees) is charged to the nearest label around it, a label's own
self time (the Python between its operators, the hooks' included) to "python:<label>". Under a LoRA
layer the base weight's F.linear and the adapter's matmuls are told apart by the weight's shape. The
prefill (the first forward) is reported apart; the rest is divided by the decode steps. Beside the
base linears and the head, their floor per step: weight bytes / read bandwidth or FLOPs / float32
matmul rate (both measured here), the larger; beside the whole call, bench/floors.py's decode floor.
The profiler inflates what it records (hooks, per-operator records): the unprofiled calls' time per
step is printed too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from bench.trl_compare import add_workload_args, measure_machine, scratch_trainer, workload_from  # noqa: E402

# the Picker's log-prob recording (only when the sampler reports log-probs: rollouts in a lower dtype than training)
PICK_LOGPROB_OPS = {"aten::log_softmax", "aten::_log_softmax", "aten::gather", "aten::div", "aten::index_put_"}


def _label_of(module, name: str, head) -> str | None:
    from peft.tuners.lora import LoraLayer

    kind = type(module).__name__
    if module is head:
        return "lm_head"
    if isinstance(module, LoraLayer):
        return "lora_linear"
    if kind.endswith("Attention"):
        return "attention"
    if kind.endswith("MLP"):
        return "mlp"
    if kind.endswith("RMSNorm"):
        return "norm"
    if kind.endswith("RotaryEmbedding"):
        return "rotary_emb"
    if isinstance(module, torch.nn.Embedding):
        return "embed"
    if kind.endswith("DecoderLayer"):
        return "layer"
    return None


def _labelled(model):
    """Forward hooks entering a record_function per labelled module call; the top model's first call is 'prefill'."""
    from torch.autograd.profiler import record_function

    head = model.get_output_embeddings()
    handles, calls = [], {"top": 0}
    top = model.get_base_model() if hasattr(model, "get_base_model") else model

    def enter(label):
        def pre(module, args, kwargs=None):
            scope = record_function(label)
            scope.__enter__()
            module.__dict__.setdefault("_h24_scopes", []).append(scope)
        return pre

    def leave(module, args, output):
        module.__dict__["_h24_scopes"].pop().__exit__(None, None, None)

    def top_pre(module, args, kwargs):
        calls["top"] += 1
        enter("prefill" if calls["top"] == 1 else "decode_forward")(module, args)

    handles.append(top.register_forward_pre_hook(top_pre, with_kwargs=True))
    handles.append(top.register_forward_hook(leave))
    for name, module in model.named_modules():
        label = _label_of(module, name, head)
        if label is None or module is top:
            continue
        handles.append(module.register_forward_pre_hook(enter(label)))
        handles.append(module.register_forward_hook(leave))
    return handles


def _wrap_picker():
    """A label around each step's token picking (Picker.__call__) and the finite check."""
    from torch.autograd.profiler import record_function

    from worker.rollout import token_picking

    originals = token_picking.Picker.__call__, token_picking.FiniteGuard.__call__

    def pick(self, *args):
        with record_function("pick"):
            return originals[0](self, *args)

    def guard(self, logits, *args):
        with record_function("finite_guard"):
            bad = ~torch.isfinite(logits).all()
            self.flag = bad if self.flag is None else self.flag | bad
        return self.pick(logits, *args)

    token_picking.Picker.__call__, token_picking.FiniteGuard.__call__ = pick, guard
    return lambda: (setattr(token_picking.Picker, "__call__", originals[0]),
                    setattr(token_picking.FiniteGuard, "__call__", originals[1]))


LABELS = {"prefill", "decode_forward", "lm_head", "lora_linear", "attention", "mlp", "norm",
          "rotary_emb", "embed", "layer", "pick", "finite_guard"}


def charge(events, rank: int) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    """(decode µs by phase, prefill µs by phase, label counts): each event's time to its nearest label; under a LoRA
    layer a linear whose weight has a dimension of at most `rank` is the adapter's."""
    decode, prefill = defaultdict(float), defaultdict(float)
    counts = defaultdict(int)

    def walk(event, label, in_prefill):
        name = event.name
        if name in LABELS:
            if name == "prefill":
                in_prefill = True
            label = name
            counts[name] += 1
            own = "python:" + name
        elif name.startswith("aten::") or name.startswith("mkl") or name.startswith("mkldnn"):
            own = _phase(label, name, event.input_shapes, rank)
            # a whole operator and all its callees go to one phase
            (prefill if in_prefill else decode)[own] += event.cpu_time_total
            return
        else:
            own = "python:" + (label or "loop")
        (prefill if in_prefill else decode)[own] += event.self_cpu_time_total
        for child in event.cpu_children:
            walk(child, label, in_prefill)

    for event in events:
        if event.cpu_parent is None:
            walk(event, None, False)
    return decode, prefill, counts


def _phase(label: str | None, op: str, shapes, rank: int) -> str:
    if op.startswith("mkldnn::_reorder_linear_weight"):  # the rollout packing its weights (packed_linears.py)
        return "packing weights"
    if label == "lora_linear":  # the lean forward calls F.linear on the base weight itself: tell it by its shape
        if op.startswith("mkldnn::_linear_pointwise"):  # a packed base weight (adapters are never packed)
            return "base_linear"
        weight = shapes[1] if op == "aten::linear" and len(shapes) > 1 else None
        return "base_linear" if weight and min(weight) > rank else "lora adapter"
    if label == "pick":
        return "logprob" if op in PICK_LOGPROB_OPS else "sampling"
    if label == "attention":
        return "attention:" + ("sdpa" if "attention" in op else "cache+rope+views")
    return {None: "loop (row drops, ids)", "decode_forward": "model (masks, positions)", "layer": "residual adds",
            "mlp": "mlp activation"}.get(label, label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--repeats", type=int, default=2, help="timed unprofiled calls (after one warm-up)")
    args = parser.parse_args()
    w = workload_from(args)
    from bench.floors import FLOAT32_BYTES, decode_bytes, decode_flops, floor_seconds
    from worker.rollout import sampling_dtype
    from worker.rollout.rollout import TransformersSampler

    print(f"torch threads {torch.get_num_threads()}; load {open('/proc/loadavg').read().split()[:3]}", flush=True)
    machine = measure_machine()
    with scratch_trainer(w) as trainer:
        policy = trainer.policy
        sampler = TransformersSampler(policy, trainer.spec.sampling, dtype=sampling_dtype(trainer.spec, policy))
        from bench.decode_floor import _prompt_lines

        prompts = [policy.tokenizer(line)["input_ids"] for line in _prompt_lines(trainer, w)]
        rows = [p for p in prompts for _ in range(w.group)]

        def call():
            started = time.perf_counter()
            tokens, _ = sampler(rows, [w.max_tokens] * len(rows), greedy=False, seeds=list(range(len(rows))))
            return time.perf_counter() - started, tokens

        call()
        times = [call()[0] for _ in range(args.repeats)]
        handles, restore = _labelled(policy.model), _wrap_picker()
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                profiled, tokens = call()
        finally:
            for h in handles:
                h.remove()
            restore()
    steps = max(len(t) for t in tokens) - 1  # forwards after the prefill
    decode, prefill, _ = charge(prof.events(), w.lora_r or 0)
    shape, step = w.shape(), w.step()
    bw, rate, rows_ = machine["bandwidth"], machine["float32"], w.batch * w.group

    def floor(params: int) -> float:  # one step's matmul over `params` weights: bytes or FLOPs, the larger
        return max(params * FLOAT32_BYTES / bw, 2 * params * rows_ / rate)

    floors = {"base_linear": floor(shape.body_linear_params), "lm_head": floor(shape.head_params)}
    print(w.describe(sum(p.numel() for p in policy.model.parameters())))
    print(f"machine: read bandwidth {bw / 1e9:.1f} GB/s, float32 matmul {rate / 1e9:.0f} GFLOP/s "
          f"(load {machine['load']:.1f})")
    median = statistics.median(times)
    whole = floor_seconds(decode_bytes(shape, step), decode_flops(shape, step), bw, rate)
    print(f"unprofiled calls {['%.2f' % t for t in times]} s = {median / whole:.2f}x the {whole:.2f} s decode floor; "
          f"{1000 * median / w.max_tokens:.1f} ms per new token; profiled {profiled:.2f} s; prefill "
          f"{sum(prefill.values()) / 1e3:.0f} ms; {steps} decode steps")
    total = sum(decode.values())
    top = sum(e.cpu_time_total for e in prof.events() if e.cpu_parent is None) / 1e6
    print(f"outside any operator or label (the loop's Python, whole call): {1000 * (profiled - top):.0f} ms")
    print("| phase | ms/step | share | floor ms/step |\n|---|---:|---:|---:|")
    for phase, us in sorted(decode.items(), key=lambda kv: -kv[1]):
        print(f"| {phase} | {us / steps / 1e3:.2f} | {100 * us / total:.1f}% | "
              f"{'%.2f' % (1000 * floors[phase]) if phase in floors else ''} |")
    print(f"| total (profiled) | {total / steps / 1e3:.2f} | | {1000 * sum(floors.values()):.2f} |")
    groups = defaultdict(float)
    for phase, us in decode.items():
        groups[_group(phase)] += us / steps / 1e3
    print("by kind (ms/step): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(groups.items(), key=lambda kv: -kv[1])))
    print(f"load at the end {open('/proc/loadavg').read().split()[:3]}")


def _group(phase: str) -> str:
    if phase.startswith("python:"):
        return "python"
    if phase.startswith("attention"):
        return "attention+cache"
    if phase in ("sampling", "logprob", "finite_guard"):
        return "sampling+logprob+guard"
    if phase in ("base_linear", "lm_head", "lora adapter", "packing weights"):
        return phase
    return "other ops (norms, activation, residual, rotary, loop)"


if __name__ == "__main__":
    main()
