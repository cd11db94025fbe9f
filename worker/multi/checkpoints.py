"""A resident job's checkpoints, in the very format a job alone writes and reads (worker/checkpoints/checkpoint.py).

The shared model holds every job's adapter under its job's name; a checkpoint
holds one adapter under PEFT's names, as `save_pretrained(selected_adapters=
["default"])` writes it (and a warm-started job's pinned reference, as
["reference"] does). `AdapterView` presents one job's adapters that way, so
save_checkpoint (atomic, sha256 manifest, no pickle) is used unchanged, and a
job moves freely between a shared worker and a worker of its own.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from worker.checkpoints.checkpoint import Checkpoint, check_lora_config, optimizer_state_dict
from worker.model.policy import REFERENCE
from worker.multi.lora import SharedBase


class AdapterView:
    """What save_checkpoint needs of a PeftModel, for one job's adapter on the shared model, and the adapter it
    pinned as its reference (`reference`: its name on the shared model) under PEFT's name for it there."""

    def __init__(self, shared: SharedBase, name: str, *, reference: str | None = None):
        self.shared, self.names = shared, {"default": name, **({REFERENCE: reference} if reference else {})}
        self.peft_config = {as_saved: shared.model.peft_config[held] for as_saved, held in self.names.items()}

    def save_pretrained(self, directory, *, selected_adapters=None, safe_serialization=True, state_dict=None):
        """As PeftModel.save_pretrained: the one selected adapter, in a subfolder of its name unless 'default'."""
        (adapter,) = selected_adapters or ["default"]
        directory = Path(directory) if adapter == "default" else Path(directory) / adapter
        directory.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().contiguous().cpu() for k, v in self.shared.adapter_state(self.names[adapter]).items()}
        save_file(weights, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
        self.peft_config[adapter].save_pretrained(str(directory))


def restore(shared: SharedBase, name: str, checkpoint: Checkpoint, optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint's adapter into job `name`'s adapter and its optimizer state into `optimizer`."""
    restore_adapter(shared, name, checkpoint)
    optimizer.load_state_dict(optimizer_state_dict(optimizer, checkpoint))


def restore_adapter(shared: SharedBase, name: str, checkpoint: Checkpoint) -> None:
    """Load a checkpoint's adapter into job `name`'s adapter (its LoRA shape checked first)."""
    check_lora_config(checkpoint.adapter_dir, shared.specs[name], shared.model, name)
    state = load_file(str(Path(checkpoint.adapter_dir) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(shared.model, state, adapter_name=name)
    unexpected = [k for k in result.unexpected_keys if "lora_" in k]
    if unexpected:
        raise ValueError(f"adapter in {checkpoint.adapter_dir} does not fit the model: unexpected {unexpected[:3]}")
