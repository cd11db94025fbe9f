"""A resident base model with its LoRA adapters: loaded once, every adapter routed per row of a batch.

The base is loaded once and held in a SharedBase (worker/multi/lora.py);
each checkpoint's adapter is downloaded from the object store (hashes
checked against its manifest), loaded under the checkpoint's id, and kept;
past `max_adapters` the least recently used one that no running row uses is
deleted. Rows of one forward each go through their own adapter, unmerged
(base(x) + B(A(x)) * scaling, the arithmetic of the trainer's own sampling
path, worker/rollout/effective_weights.py), or through the base alone.
"""

from __future__ import annotations

import logging
import shutil
from collections import OrderedDict
from pathlib import Path

from transformers import AutoTokenizer

from service.storage import ObjectStore
from worker.checkpoints.artifacts import download_checkpoint
from worker.checkpoints.checkpoint import load_checkpoint
from worker.model import precision
from worker.model.loading import load_causal_lm
from worker.model.policy import pick_device
from worker.multi.lora import SharedBase

log = logging.getLogger(__name__)


class ResidentModel:
    def __init__(self, base: str, *, store: ObjectStore, scratch: Path, max_adapters: int):
        self.base, self.store, self.scratch, self.max_adapters = base, store, scratch, max_adapters
        self.device = pick_device()
        self.dtype = precision.compute_dtype("auto", base, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        self.shared = SharedBase(load_causal_lm(base, dtype=self.dtype).to(self.device).eval())
        self.max_len = getattr(self.shared.base.config, "max_position_embeddings", None) or 2048
        self.adapters: OrderedDict[str, None] = OrderedDict()  # checkpoint id -> loaded, oldest use first

    @property
    def model(self):
        """The causal LM to decode with: the base, whose LoRA linears (PEFT injects them in place) route each row
        through its own adapter."""
        return self.shared.base

    @property
    def router(self):
        return self.shared.router

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    def adapter(self, checkpoint: dict | None, in_use: set[str] = frozenset()) -> str | None:
        """The name rows of this checkpoint are routed by (None: the base), its adapter loaded if it is not kept;
        adapters in `in_use` (rows decoding now) are never the ones evicted."""
        if checkpoint is None:
            return None
        self._load(checkpoint, in_use)
        return checkpoint["id"]

    def _load(self, checkpoint: dict, in_use: set[str]) -> None:
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
            self.shared.load(name, str(adapter_dir))
        finally:
            shutil.rmtree(local, ignore_errors=True)  # the weights are in memory now
        self.adapters[name] = None
        log.info("serving %s: loaded adapter %s (%d kept)", self.base, name, len(self.adapters))
        for old in [n for n in self.adapters if n != name and n not in in_use]:
            if len(self.adapters) <= self.max_adapters:
                break
            del self.adapters[old]
            self.shared.remove(old)
            log.info("serving %s: dropped adapter %s (least recently used)", self.base, old)

    def prompt_ids(self, prompt: dict) -> list[int]:
        if "messages" in prompt:
            from worker.model.turns import chat_ids

            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(f"{self.base} has no chat template: use /v1/completions with a text prompt")
            return chat_ids(self.tokenizer, prompt["messages"])
        return list(self.tokenizer(prompt["text"])["input_ids"])
