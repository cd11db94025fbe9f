"""What oneDNN-prepacked float32 weights give our float32 rollouts (the measurement behind the sampler's own
packing, which this bench switches off for its "sgemm" side).

    flock /tmp/bigmem.lock .venv/bin/python bench/packed_float32.py --shape qwen2.5-0.5b --threads 1

bench/decode_floor.py's workload and sampler. Float32 rollouts ran every linear through MKL's sgemm
(F.linear), which at decode's 16 rows repacks each weight at every call; oneDNN's prepacked kernel
(worker/rollout/packed_linears.py, used for bfloat16 rollouts) rounds differently, so the logits move by
~1e-6 and the rollout no longer gives the trainer's logits bit for bit. This prints what that trade buys:
the decode time on sgemm and on packed copies of the base linears and the LM head (alternating calls,
medians), the time and bytes of packing them, and how far the packed path moves: the max abs difference
of the logits of a full forward over the sampled sequences, of the recorded log-probs, and how many
completions stay the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
from itertools import takewhile
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from bench.decode_floor import _prompt_lines  # noqa: E402
from bench.trl_compare import add_workload_args, scratch_trainer, workload_from  # noqa: E402


class PackedLinears:
    """The policy's LoRA base linears and LM head switched between F.linear and oneDNN-packed float32 copies."""

    def __init__(self, model):
        from peft.tuners.lora import LoraLayer

        self.linears = [m.get_base_layer() for m in model.modules() if isinstance(m, LoraLayer)]
        self.linears.append(model.get_output_embeddings())
        self.packs: dict = {}

    def pack(self) -> tuple[float, int]:
        """(seconds, bytes) of packing every weight once."""
        started = time.perf_counter()
        for linear in self.linears:
            self.packs[linear] = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 16)
        return time.perf_counter() - started, sum(linear.weight.nbytes for linear in self.linears)

    def use(self, packed: bool) -> None:
        from worker.rollout.packed_linears import packed_forward

        for linear in self.linears:
            if packed:
                linear.forward = packed_forward(linear, self.packs[linear])
            elif "forward" in linear.__dict__:
                del linear.forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls of each kind, alternating")
    args = parser.parse_args()
    w = workload_from(args)
    from worker.rollout import sampling_dtype
    from worker.rollout.effective_weights import rollout_weights
    from worker.rollout.rollout import TransformersSampler
    from worker.rollout import packed_linears

    # The sampler now packs float32 weights itself (worker/rollout/packed_linears.py): off here, so the "sgemm"
    # side is the unpacked path this bench compares against.
    packed_linears.FLOAT32_PACK_MIN_ELEMENTS = 1 << 62

    print(f"torch threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.2f}", flush=True)
    with scratch_trainer(w) as trainer:
        policy = trainer.policy
        if policy.model.get_output_embeddings().weight.dtype != torch.float32:
            raise SystemExit("a float32 model only (--dtype float32)")
        sampler = TransformersSampler(policy, trainer.spec.sampling, dtype=sampling_dtype(trainer.spec, policy),
                                       logprobs=True)
        prompts = [policy.tokenizer(line)["input_ids"] for line in _prompt_lines(trainer, w)]
        rows = [p for p in prompts for _ in range(w.group)]

        def call():
            started = time.perf_counter()
            tokens, logprobs = sampler(rows, [w.max_tokens] * len(rows), greedy=False, seeds=list(range(len(rows))))
            return time.perf_counter() - started, tokens, logprobs

        def logits(seqs):
            with torch.no_grad(), rollout_weights(policy.model) as model:
                return model(input_ids=seqs).logits

        linears = PackedLinears(policy.model)
        pack_seconds, pack_bytes = linears.pack()
        call()
        _, tokens, logprobs = call()
        full = [r + t for r, t in zip(rows, tokens) if len(t) == w.max_tokens]  # same length: one batch, no padding
        seqs = torch.tensor(full)
        plain = logits(seqs)
        linears.use(True)
        packed = logits(seqs)
        call()
        _, packed_tokens, packed_logprobs = call()
        times: dict[str, list[float]] = {"sgemm": [], "packed": []}
        for _ in range(args.repeats):
            for kind in times:
                linears.use(kind == "packed")
                times[kind].append(call()[0])
        linears.use(False)
    same = sum(a == b for a, b in zip(tokens, packed_tokens))
    shared = [abs(x - y) for a, b, ta, tb in zip(logprobs, packed_logprobs, tokens, packed_tokens)
              for x, y, _, _ in takewhile(lambda q: q[2] == q[3], zip(a, b, ta, tb))]  # before a first difference
    sgemm, fast = statistics.median(times["sgemm"]), statistics.median(times["packed"])
    print(w.describe(sum(p.numel() for p in policy.model.parameters())))
    print(f"packing the {len(linears.linears)} weights: {pack_seconds:.2f} s, {pack_bytes / 1e9:.2f} GB more memory "
          f"while the copies are kept")
    print(f"logits of a full forward over {tuple(seqs.shape)}: max abs difference {(plain - packed).abs().max():.2e} "
          f"(max |logit| {plain.abs().max():.2f}); recorded log-probs max abs difference "
          f"{max(shared, default=0.0):.2e}; completions identical {same}/{len(tokens)}")
    print(f"decode: sgemm {['%.2f' % t for t in times['sgemm']]} s, packed {['%.2f' % t for t in times['packed']]} s: "
          f"{sgemm / fast:.2f}x faster ({1000 * sgemm / w.max_tokens:.0f} -> {1000 * fast / w.max_tokens:.0f} ms per "
          f"new token); load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
