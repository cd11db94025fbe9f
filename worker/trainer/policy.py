"""The trained policy: base model + LoRA adapter, its tokenizer, and its reference.

The reference policy is the base model with adapters disabled, unless the job
warm-starts from a checkpoint: then the loaded adapter is pinned as a frozen
second adapter named 'reference' (and saved with every checkpoint, so a
resumed job keeps it).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from service.schemas.job_spec import JobSpec, LoraSpec
from worker.checkpoint import Checkpoint, check_lora_config

REFERENCE = "reference"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Policy:
    model: PeftModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device

    @property
    def has_pinned_reference(self) -> bool:
        return REFERENCE in self.model.peft_config

    @contextmanager
    def reference(self):
        """Run the model as the reference policy inside the block (no grad)."""
        with torch.no_grad():
            if self.has_pinned_reference:
                self.model.set_adapter(REFERENCE)
                try:
                    yield
                finally:
                    self.model.set_adapter("default")  # also restores requires_grad
            else:
                with self.model.disable_adapter():
                    yield

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def lora_config(spec: LoraSpec) -> LoraConfig:
    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,
        task_type="CAUSAL_LM",
    )


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_policy(spec: JobSpec, *, resume_from: Checkpoint | None, warm_start: Checkpoint | None) -> Policy:
    """Base model + adapter. A resumed job restores adapter and reference from its checkpoint."""
    device = pick_device()
    tokenizer = AutoTokenizer.from_pretrained(spec.model)
    tokenizer.padding_side = "left"  # generation continues from the prompt's end
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = DTYPES.get(spec.dtype, "auto")
    if dtype == "auto" and device.type == "cpu":
        dtype = torch.float32  # half precision on CPU is slow and lossy
    base = AutoModelForCausalLM.from_pretrained(spec.model, dtype=dtype).to(device)
    model = get_peft_model(base, lora_config(spec.lora))

    source = resume_from or warm_start
    if source is not None:
        check_lora_config(source.adapter_dir, spec.lora)
        _load_adapter_weights(model, source.adapter_dir, "default")
    reference_dir = resume_from.reference_dir if resume_from is not None else (
        warm_start.adapter_dir if warm_start is not None else None
    )
    if reference_dir is not None:
        model.add_adapter(REFERENCE, lora_config(spec.lora))
        _load_adapter_weights(model, Path(reference_dir), REFERENCE)
        model.set_adapter("default")
    for name, p in model.named_parameters():
        if f".{REFERENCE}." in name:
            p.requires_grad_(False)
    return Policy(model=model, tokenizer=tokenizer, device=device)


def _load_adapter_weights(model: PeftModel, adapter_dir: Path, adapter_name: str) -> None:
    state = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state, adapter_name=adapter_name)
    unexpected = [k for k in result.unexpected_keys if "lora_" in k]
    if unexpected:
        raise ValueError(f"adapter in {adapter_dir} does not fit the model: unexpected {unexpected[:3]}")
