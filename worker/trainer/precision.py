"""Mixed precision: trainable weights and optimizer state in float32, the forward passes in the job's dtype.

`spec.dtype` is the compute dtype ("auto": the checkpoint's own dtype on a
GPU, float32 on a CPU). When it is lower than float32:

- trainable parameters (the whole model, or the LoRA adapters) stay float32,
  the master weights, so an update smaller than a bf16 step (lr * 1e-3 of a
  weight of 1 is below bf16's 2^-8) still accumulates;
- frozen weights (the LoRA base, a full job's reference copy) are held in the
  compute dtype: they never change, so half the memory costs nothing;
- one process runs its forwards under torch.autocast(dtype); with several
  processes FSDP2's MixedPrecisionPolicy casts the gathered parameters instead
  (param_dtype) and reduces gradients in float32 (see worker/distributed/shard.py).
  The two round at slightly different points, so they agree to bf16's
  precision, not bit for bit.

Checkpoints save a whole model in the compute dtype (what a user loads) and
its float32 master weights in the trainer state, so a resume is exact.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import AutoConfig

from worker.distributed import group

MASTER = torch.float32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(name: str, model: str, device: torch.device) -> torch.dtype:
    """The dtype of the forward passes: the spec's, or for "auto" the checkpoint's own on a GPU."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # half precision on CPU is slow and lossy
    saved = getattr(AutoConfig.from_pretrained(model), "dtype", None)
    if isinstance(saved, str):
        saved = DTYPES.get(saved)
    return saved if saved in DTYPES.values() else torch.float32


def is_mixed(dtype: torch.dtype) -> bool:
    return dtype != MASTER


def autocast(device: torch.device, dtype: torch.dtype):
    """The forward-pass context of one process; nothing under FSDP, whose policy casts the parameters."""
    if not is_mixed(dtype) or group.active():
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)
