"""Peak memory and time of token log-probs: chunked LM head (ours) vs full float32 logits (the naive peer).

    python bench/logprob_memory.py [--batch 8 --seq 1024 --hidden 896 --vocab 32000]

Each variant runs forward + backward in a fresh subprocess, so its peak
resident memory (CPU) or peak CUDA allocation is its own. Prints one row per
variant and the ratio against the naive computation measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def run_variant(variant: str, args) -> dict:
    import torch

    from worker.cispo.logprobs import token_logprobs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device).requires_grad_(False)  # frozen, as under LoRA
    hidden = torch.randn(args.batch, args.seq, args.hidden, device=device, requires_grad=True)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if variant == "naive":
        logp = torch.log_softmax(head(hidden).float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    else:
        logp, _ = token_logprobs(head, hidden, targets, chunk_size=args.chunk)
    logp.sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) * 1024)
    return {"variant": variant, "device": device, "seconds": seconds, "peak_mib": peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args)))
        return
    rows = []
    for variant in ("naive", "chunked"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    naive = rows[0]
    print(f"tokens={args.batch * args.seq} vocab={args.vocab} device={naive['device']}")
    print(f"{'variant':<8} {'peak MiB':>9} {'seconds':>8} {'mem vs naive':>13} {'time vs naive':>14}")
    for r in rows:
        print(f"{r['variant']:<8} {r['peak_mib']:9.0f} {r['seconds']:8.2f} {r['peak_mib'] / naive['peak_mib']:13.2f} "
              f"{r['seconds'] / naive['seconds']:14.2f}")


if __name__ == "__main__":
    main()
