"""The trained policy: the model (base + LoRA adapter, or every weight), its tokenizer, and its reference.

LoRA: the reference policy is the base model with adapters disabled, unless
the job warm-starts from a checkpoint: then the loaded adapter is pinned as a
frozen second adapter named 'reference' (and saved with every checkpoint, so a
resumed job keeps it).

Full fine-tuning (`lora: null`): every weight trains. The reference is a
frozen copy of the starting weights, kept only when the loss has a KL term
(kl_beta > 0); a warm start pins the loaded model (saved with checkpoints).

With several processes the model (and the frozen copy) is sharded with FSDP2
after loading; whole weights are loaded on every rank first.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from service.schemas.job_spec import JobSpec, LoraSpec
from worker.checkpoint import Checkpoint, CheckpointError, check_lora_config
from worker.distributed import group
from worker.distributed.shard import shard_model

REFERENCE = "reference"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Policy:
    model: torch.nn.Module  # a PeftModel, or the whole model for full fine-tuning
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    reference_model: torch.nn.Module | None = None  # full fine-tuning with a KL term: frozen starting weights
    pinned_full_reference: bool = False  # reference_model came from a checkpoint (saved with checkpoints)

    @property
    def is_lora(self) -> bool:
        return isinstance(self.model, PeftModel)

    @property
    def has_pinned_reference(self) -> bool:
        return REFERENCE in self.model.peft_config if self.is_lora else self.pinned_full_reference

    @contextmanager
    def reference(self):
        """Yields the module that computes the reference policy (no grad inside the block)."""
        with torch.no_grad():
            if not self.is_lora:
                if self.reference_model is None:
                    raise RuntimeError("full fine-tuning keeps a reference model only when loss.kl_beta > 0")
                yield self.reference_model
            elif REFERENCE in self.model.peft_config:
                self.model.set_adapter(REFERENCE)
                try:
                    yield self.model
                finally:
                    self.model.set_adapter("default")  # also restores requires_grad
            else:
                with self.model.disable_adapter():
                    yield self.model

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
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())  # torchrun set this rank's GPU
    return torch.device("cpu")


def load_policy(spec: JobSpec, *, resume_from: Checkpoint | None, warm_start: Checkpoint | None) -> Policy:
    """The model to train. A resumed job restores weights and reference from its checkpoint."""
    device = pick_device()
    tokenizer = AutoTokenizer.from_pretrained(spec.model)
    tokenizer.padding_side = "left"  # generation continues from the prompt's end
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = DTYPES.get(spec.dtype, "auto")
    if dtype == "auto" and device.type == "cpu":
        dtype = torch.float32  # half precision on CPU is slow and lossy

    def from_pretrained(where) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype).to(device)
        if spec.training.gradient_checkpointing:
            # Non-reentrant: works with frozen inputs (LoRA) and with FSDP2's hooks.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    for ckpt in (resume_from, warm_start):
        if ckpt is not None and (ckpt.model_dir is None) != (spec.lora is not None):
            have, want = ("an adapter", "a whole model") if ckpt.model_dir is None else ("a whole model", "an adapter")
            raise CheckpointError(f"checkpoint {ckpt.path} holds {have}, but the job (lora: "
                                  f"{'null' if spec.lora is None else 'set'}) needs {want}")
    if spec.lora is None:
        model, reference, pinned = _full_model(spec, from_pretrained, resume_from, warm_start)
        policy = Policy(model, tokenizer, device, reference_model=reference, pinned_full_reference=pinned)
    else:
        policy = Policy(_lora_model(spec, from_pretrained(spec.model), resume_from, warm_start), tokenizer, device)
    if group.active():
        shard_model(policy.model, device)
        if policy.reference_model is not None:
            shard_model(policy.reference_model, device)
    return policy


def _full_model(spec: JobSpec, from_pretrained, resume_from: Checkpoint | None,
                warm_start: Checkpoint | None) -> tuple[torch.nn.Module, torch.nn.Module | None, bool]:
    """(model, reference or None, whether the reference came from a checkpoint)."""
    source = resume_from or warm_start
    model = from_pretrained(source.model_dir if source is not None else spec.model)
    reference, pinned = None, False
    if spec.loss.kl_beta > 0:
        pinned_dir = resume_from.reference_dir if resume_from is not None else (
            warm_start.model_dir if warm_start is not None else None)
        if pinned_dir is not None:
            reference, pinned = from_pretrained(pinned_dir), True
        elif resume_from is not None:
            reference = from_pretrained(spec.model)  # the run started from the base model
        else:
            reference = copy.deepcopy(model)
        reference.requires_grad_(False)
        reference.eval()
    return model, reference, pinned


def _lora_model(spec: JobSpec, base: torch.nn.Module, resume_from: Checkpoint | None,
                warm_start: Checkpoint | None) -> PeftModel:
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
    return model


def _load_adapter_weights(model: PeftModel, adapter_dir: Path, adapter_name: str) -> None:
    state = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state, adapter_name=adapter_name)
    unexpected = [k for k in result.unexpected_keys if "lora_" in k]
    if unexpected:
        raise ValueError(f"adapter in {adapter_dir} does not fit the model: unexpected {unexpected[:3]}")
