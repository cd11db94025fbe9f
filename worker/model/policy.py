"""The trained policy: the model (base + LoRA adapter, or every weight), its tokenizer, and its reference.

LoRA: the reference policy is the base model with adapters disabled, unless
the job warm-starts from a checkpoint: then the loaded adapter is pinned as a
frozen second adapter named 'reference' (and saved with every checkpoint, so a
resumed job keeps it).

Full fine-tuning (`lora: null`): every weight trains. The reference is a
frozen copy of the starting weights, kept only when the loss has a KL term
(kl_beta > 0); a warm start pins the loaded model (saved with checkpoints).

Trainable weights are float32 master weights and frozen ones are held in the
compute dtype; `autocast()` runs a forward in that dtype (worker/model/precision.py).

With several processes only rank 0 reads the weights: the other ranks build
the same modules on the meta device (from the config; PEFT wraps them there
too), every rank shards with FSDP2, and the other ranks then receive rank 0's
weights into their shards (worker/distributed/state.py). So one whole copy of
the model exists in host memory, not one per rank.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from service.job_spec.spec import JobSpec, LoraSpec
from worker.checkpoints.checkpoint import Checkpoint, CheckpointError, check_lora_config
from worker.distributed import group
from worker.distributed.shard import shard_model
from worker.distributed.state import receive_from_rank0
from worker.model import precision, quantization
from worker.model.loading import load_causal_lm

REFERENCE = "reference"
MASTER_PREFIX = "master."  # a whole model's float32 weights among a checkpoint's trainer-state tensors


@dataclass
class Policy:
    model: torch.nn.Module  # a PeftModel, or the whole model for full fine-tuning
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    reference_model: torch.nn.Module | None = None  # full fine-tuning with a KL term: frozen starting weights
    pinned_full_reference: bool = False  # reference_model came from a checkpoint (saved with checkpoints)
    compute_dtype: torch.dtype = torch.float32  # forwards run in it; trainable weights stay float32
    lm_head_float32: bool = False  # training.lm_head_float32: the sampler's LM head runs in float32 too

    def autocast(self):
        """The context every forward pass runs in (bf16 compute on float32 master weights in one process)."""
        return precision.autocast(self.device, self.compute_dtype)

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


def enable_gradient_checkpointing(model: torch.nn.Module, *, context_fn=None) -> None:
    """training.gradient_checkpointing: each decoder layer's activations recomputed in the backward. Non-reentrant:
    works with frozen inputs (LoRA) and with FSDP2's hooks. `context_fn`: torch's checkpoint argument, the
    contexts of a layer's forward and of its recompute (the shared base restores its rows' routing there)."""
    kwargs = {"use_reentrant": False, **({"context_fn": context_fn} if context_fn is not None else {})}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())  # torchrun set this rank's GPU
    return torch.device("cpu")


def load_policy(spec: JobSpec, *, resume_from: Checkpoint | None, warm_start: Checkpoint | None) -> Policy:
    """The model to train. A resumed job restores weights and reference from its checkpoint."""
    quantization.refuse_unavailable_quantization(spec)  # before anything is loaded
    device = pick_device()
    precision.enable_fast_matmul(device)
    tokenizer = AutoTokenizer.from_pretrained(spec.model)
    tokenizer.padding_side = "left"  # generation continues from the prompt's end
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = precision.compute_dtype(spec.dtype, spec.model, device)
    reads = group.rank() == 0  # the other ranks build on meta and receive rank 0's weights after sharding

    def from_pretrained(where, load_dtype: torch.dtype, **extra) -> torch.nn.Module:
        if reads:
            model = load_causal_lm(where, dtype=load_dtype, **extra)
            if not group.active() and not extra:  # a 4-bit model is placed by its device_map
                model = model.to(device)  # under FSDP fully_shard moves only this rank's shard to the device
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(where), dtype=load_dtype)
        if spec.training.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        return model

    for ckpt in (resume_from, warm_start):
        if ckpt is not None and (ckpt.model_dir is None) != (spec.lora is not None):
            have, want = ("an adapter", "a whole model") if ckpt.model_dir is None else ("a whole model", "an adapter")
            raise CheckpointError(f"checkpoint {ckpt.path} holds {have}, but the job (lora: "
                                  f"{'null' if spec.lora is None else 'set'}) needs {want}")
    if spec.lora is None:
        model, reference, pinned = _full_model(spec, from_pretrained, dtype, resume_from, warm_start, reads)
        policy = Policy(model, tokenizer, device, reference_model=reference, pinned_full_reference=pinned,
                        compute_dtype=dtype)
    else:
        # The frozen base in the compute dtype; PEFT keeps the adapters float32 (autocast_adapter_dtype).
        base = from_pretrained(spec.model, dtype, **quantization.base_load_kwargs(spec, dtype, device))
        with nullcontext() if reads else torch.device("meta"):
            model = _lora_model(spec, base, resume_from, warm_start, reads)
        policy = Policy(model, tokenizer, device, compute_dtype=dtype)
    if group.active():
        for module in (policy.model, policy.reference_model):
            if module is not None:
                whole = module.state_dict() if reads else None  # before sharding: plain whole tensors
                shard_model(module, device, dtype)
                receive_from_rank0(module, whole, device)
                del whole
    policy.lm_head_float32 = spec.training.lm_head_float32
    return policy


def _full_model(spec: JobSpec, from_pretrained, dtype: torch.dtype, resume_from: Checkpoint | None,
                warm_start: Checkpoint | None, reads: bool) -> tuple[torch.nn.Module, torch.nn.Module | None, bool]:
    """(model in float32, reference in the compute dtype or None, whether the reference came from a checkpoint)."""
    source = resume_from or warm_start
    model = from_pretrained(source.model_dir if source is not None else spec.model, precision.MASTER)
    masters = _master_weights(source) if source is not None and reads else {}
    if masters:  # the model files hold the compute dtype; these are the exact float32 weights
        model.load_state_dict(masters)
    reference, pinned = None, False
    if spec.loss.kl_beta > 0:
        pinned_dir = resume_from.reference_dir if resume_from is not None else (
            warm_start.model_dir if warm_start is not None else None)
        if pinned_dir is not None:
            reference, pinned = from_pretrained(pinned_dir, dtype), True
        elif resume_from is not None:
            reference = from_pretrained(spec.model, dtype)  # the run started from the base model
        else:
            reference = copy.deepcopy(model).to(dtype)
        reference.requires_grad_(False)
        reference.eval()
    return model, reference, pinned


def _master_weights(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    return {k.removeprefix(MASTER_PREFIX): v for k, v in ckpt.tensors.items() if k.startswith(MASTER_PREFIX)}


def _lora_model(spec: JobSpec, base: torch.nn.Module, resume_from: Checkpoint | None,
                warm_start: Checkpoint | None, reads: bool) -> PeftModel:
    """The base with the job's adapter (and a pinned reference adapter); weights are read only when `reads`."""
    model = get_peft_model(base, lora_config(spec.lora))
    source = resume_from or warm_start
    if source is not None:
        check_lora_config(source.adapter_dir, spec.lora, model)
        if reads:
            _load_adapter_weights(model, source.adapter_dir, "default")
    reference_dir = pinned_reference_dir(resume_from, warm_start)
    if reference_dir is not None:
        model.add_adapter(REFERENCE, lora_config(spec.lora))
        if reads:
            _load_adapter_weights(model, Path(reference_dir), REFERENCE)
        model.set_adapter("default")
    for name, p in model.named_parameters():
        if f".{REFERENCE}." in name:
            p.requires_grad_(False)
    return model


def pinned_reference_dir(resume_from: Checkpoint | None, warm_start: Checkpoint | None) -> Path | None:
    """The adapter a LoRA job pins as its reference policy: a resumed job's saved one (if it pinned one), else the
    adapter it warm-starts from; None: the base with adapters disabled is the reference."""
    if resume_from is not None:
        return resume_from.reference_dir
    return warm_start.adapter_dir if warm_start is not None else None


def _load_adapter_weights(model: PeftModel, adapter_dir: Path, adapter_name: str) -> None:
    state = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state, adapter_name=adapter_name)
    unexpected = [k for k in result.unexpected_keys if "lora_" in k]
    if unexpected:
        raise ValueError(f"adapter in {adapter_dir} does not fit the model: unexpected {unexpected[:3]}")
