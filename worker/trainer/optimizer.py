"""The optimizer every job trains with: AdamW on the job's trainable parameters, as its spec says."""

from __future__ import annotations

import torch

from service.job_spec.objective import OptimizerSpec


def adamw(params, spec: OptimizerSpec) -> torch.optim.AdamW:
    """`foreach=True` on every device: torch picks it on CUDA by itself but loops over the tensors in Python on a
    CPU; the foreach ops give the same numbers bit for bit (tests/worker/trainer/test_optimizer.py) with one call per op
    for all tensors (a toy LoRA's 28 tensors, one thread: 0.76 -> 0.50 ms a step)."""
    return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                             foreach=True)
