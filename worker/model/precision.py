"""Mixed precision: trainable weights and optimizer state in float32, the forward passes in the job's dtype.

`spec.dtype` is the compute dtype ("auto": bfloat16 for a half-precision
checkpoint, float16 ones included, on a GPU that has bfloat16 or a CPU with
bfloat16 matmul instructions (AVX512-BF16 or AMX), else float32; on such a CPU
the toy task learns as in float32: bench/README.md, bench/bf16_learning.py).
float16 training is refused at validation: without loss scaling, a loss
that is a mean over ~10^4 tokens gives gradients below float16's range, and a
float16 overflow turns logits into NaN. When the compute dtype is lower than float32:

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


def rollout_dtype(spec) -> torch.dtype | None:
    """A job spec's rollout.dtype as a torch dtype; None for 'auto' (it samples in the dtype it trains in)."""
    return None if spec.rollout.dtype == "auto" else DTYPES[spec.rollout.dtype]


def compute_dtype(name: str, model: str, device: torch.device) -> torch.dtype:
    """The dtype of the forward passes: the spec's, or for "auto" bfloat16 for a half-precision checkpoint on a
    device with fast bfloat16 (float32 otherwise)."""
    if name != "auto":
        return DTYPES[name]
    saved = getattr(AutoConfig.from_pretrained(model), "dtype", None)
    if isinstance(saved, str):
        saved = DTYPES.get(saved)
    if saved in (torch.bfloat16, torch.float16) and bf16_supported(device):
        return torch.bfloat16  # float16's range underflows gradients and overflows logits without loss scaling
    return torch.float32


def bf16_supported(device: torch.device) -> bool:
    """A GPU with bfloat16, or a CPU whose matmuls run bfloat16 natively (without AVX512-BF16 or AMX torch
    emulates it, slower than float32)."""
    if device.type == "cpu":
        return any(getattr(torch.cpu, probe, lambda: False)()
                   for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def emulated_bf16_warning(dtypes: set[torch.dtype], device: torch.device) -> str | None:
    """A warning for a job that asked for bfloat16 (dtype or rollout.dtype) on a device without native bfloat16
    matmuls, where torch emulates it: on a CPU without AVX512-BF16 or AMX a large bfloat16 matmul runs tens of
    times slower than float32 (1.5 against 69 GFLOP/s on an AVX2 EPYC, bench/README.md)."""
    if torch.bfloat16 not in dtypes or bf16_supported(device):
        return None
    what = ("a CPU without bfloat16 matmul instructions (AVX512-BF16 or AMX)" if device.type == "cpu"
            else f"a {device.type} device without native bfloat16")
    return (f"bfloat16 runs emulated on {what}, many times slower than float32; set dtype and rollout.dtype to "
            "'auto' (float32 on this device) or 'float32'")


def enable_fast_matmul(device: torch.device) -> None:
    """TF32 for the float32 matmuls on CUDA (master-weight forwards, float32 jobs): ~8x their speed on Ampere
    and later, at bfloat16-like input rounding with float32 accumulation. Nothing changes on a CPU."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


def is_mixed(dtype: torch.dtype) -> bool:
    return dtype != MASTER


def autocast(device: torch.device, dtype: torch.dtype):
    """The forward-pass context of one process; nothing under FSDP, whose policy casts the parameters."""
    if not is_mixed(dtype) or group.active():
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)
