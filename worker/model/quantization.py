"""QLoRA (lora.base_quantization 'nf4'): the frozen base model held in 4-bit NF4 by bitsandbytes.

The adapters train in float32 on top of it, as in QLoRA (Dettmers et al., 2023): NF4 weights, double
quantisation of their scales, matmuls in the compute dtype. bitsandbytes is not a dependency of this
project; a worker without it refuses the job before loading anything (invalid_job), and the dry run says
so too (service/dry_run.py). The hf sampler runs such a model with its adapters unmerged
(worker/rollout/effective_weights.py: a 4-bit weight cannot take the adapter folded in).
"""

from __future__ import annotations

import importlib.util

import torch

from service.job_spec.spec import JobSpec


def wants_4bit_base(spec: JobSpec) -> bool:
    return spec.lora is not None and spec.lora.base_quantization == "nf4"


def bitsandbytes_installed() -> bool:
    try:
        return importlib.util.find_spec("bitsandbytes") is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        return False


def refuse_unavailable_quantization(spec: JobSpec) -> None:
    """ValueError naming lora.base_quantization when this worker cannot hold the base in 4 bits."""
    if not wants_4bit_base(spec):
        return
    if not bitsandbytes_installed():
        raise ValueError("lora.base_quantization is 'nf4' (QLoRA) but bitsandbytes is not installed on this worker: "
                         "install bitsandbytes on a CUDA worker, or set lora.base_quantization to 'none'")
    if not torch.cuda.is_available():
        raise ValueError("lora.base_quantization is 'nf4' (QLoRA) but this worker has no CUDA GPU, which "
                         "bitsandbytes' 4-bit matmuls need; set lora.base_quantization to 'none'")


def base_load_kwargs(spec: JobSpec, compute_dtype: torch.dtype, device: torch.device) -> dict:
    """Extra from_pretrained arguments for the LoRA base: the 4-bit config, placed on the device at load."""
    if not wants_4bit_base(spec):
        return {}
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                      bnb_4bit_use_double_quant=True,
                                                      bnb_4bit_compute_dtype=compute_dtype),
            "device_map": {"": device}}
