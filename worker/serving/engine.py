"""A resident base model with its LoRA adapters: loaded once, adapters swapped in per request.

The base is loaded once and wrapped in one PeftModel; each checkpoint's
adapter is downloaded from the object store (hashes checked against its
manifest), loaded under the checkpoint's id, and kept; past `max_adapters`
the least recently used is deleted. A request runs on its adapter folded
into the weights (worker/rollout/effective_weights.py's rollout_weights: the trainer's
own sampling path, so a fine-tuned model answers here as it did in its
rollouts), or with every adapter switched off for the base itself.
"""

from __future__ import annotations

import logging
import shutil
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

from transformers import AutoTokenizer

from service.storage import ObjectStore
from worker.artifacts import download_checkpoint
from worker.checkpoint import load_checkpoint
from worker.model import precision
from worker.model.loading import load_causal_lm
from worker.rollout.effective_weights import rollout_weights
from worker.model.policy import pick_device

log = logging.getLogger(__name__)


class ResidentModel:
    def __init__(self, base: str, *, store: ObjectStore, scratch: Path, max_adapters: int):
        self.base, self.store, self.scratch, self.max_adapters = base, store, scratch, max_adapters
        self.device = pick_device()
        self.dtype = precision.compute_dtype("auto", base, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        self.model = load_causal_lm(base, dtype=self.dtype).to(self.device).eval()
        self.max_len = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self.adapters: OrderedDict[str, None] = OrderedDict()  # checkpoint id -> loaded, oldest use first

    @contextmanager
    def weights(self, checkpoint: dict | None):
        """The causal LM to decode with: the base, or the base with this checkpoint's adapter folded in."""
        from peft import PeftModel

        if checkpoint is None:
            if isinstance(self.model, PeftModel):
                with self.model.disable_adapter():
                    yield self.model
            else:
                yield self.model
            return
        self._load(checkpoint)
        self.model.set_adapter(checkpoint["id"])
        with rollout_weights(self.model, self.dtype) as folded:
            yield folded

    def _load(self, checkpoint: dict) -> None:
        from peft import PeftModel

        name = checkpoint["id"]
        if name in self.adapters:
            self.adapters.move_to_end(name)
            return
        local = self.scratch / name
        shutil.rmtree(local, ignore_errors=True)
        download_checkpoint(self.store, checkpoint["prefix"], checkpoint["files"], local)
        try:
            adapter_dir = load_checkpoint(local).adapter_dir  # verifies every file against the manifest
            if adapter_dir is None:
                raise ValueError(f"checkpoint {name} holds no adapter")
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(str(adapter_dir), adapter_name=name, is_trainable=False)
            else:
                self.model = PeftModel.from_pretrained(self.model, str(adapter_dir), adapter_name=name,
                                                       is_trainable=False).eval()
        finally:
            shutil.rmtree(local, ignore_errors=True)  # the weights are in memory now
        self.adapters[name] = None
        log.info("serving %s: loaded adapter %s (%d kept)", self.base, name, len(self.adapters))
        while len(self.adapters) > self.max_adapters:
            old, _ = self.adapters.popitem(last=False)
            self.model.delete_adapter(old)
            log.info("serving %s: dropped adapter %s (least recently used)", self.base, old)

    def prompt_ids(self, prompt: dict) -> list[int]:
        if "messages" in prompt:
            from worker.model.turns import chat_ids

            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(f"{self.base} has no chat template: use /v1/completions with a text prompt")
            return chat_ids(self.tokenizer, prompt["messages"])
        return list(self.tokenizer(prompt["text"])["input_ids"])
