"""A LoRA checkpoint merged into its base model: one directory that `AutoModelForCausalLM.from_pretrained` loads
with no PEFT (config.json, the tokenizer, model.safetensors), for serving stacks that take plain weights.

Written by the worker when a job asks for it (`training.export: merged`), next to each checkpoint it keeps: the
merge loads a second copy of the base model on the CPU, which has no place on the API's request threads. Like a
checkpoint, the directory is built aside and renamed into place, and its `manifest.json` (every file's sha256,
written last) says it is complete; it is stored under the checkpoint's prefix as `merged/...` plus one
reproducible tar, `merged.tar`, which GET .../checkpoints/{id}/merged serves.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch

from service.storage_layout import MANIFEST, MERGED_ARCHIVE, MERGED_DIR
from worker.checkpoints.artifacts import upload_tree
from worker.checkpoints.checkpoint import fsync_dir, file_sha256
from worker.model.precision import DTYPES


def save_dtype(spec_dtype: str, base_model: str) -> torch.dtype:
    """The merged weights' dtype: the job's, or for "auto" the base model's own (float32 when it names none)."""
    if spec_dtype != "auto":
        return DTYPES[spec_dtype]
    from transformers import AutoConfig

    saved = getattr(AutoConfig.from_pretrained(base_model), "dtype", None)
    saved = DTYPES.get(saved) if isinstance(saved, str) else saved
    return saved if saved in DTYPES.values() else torch.float32


def merge_adapter(base_model: str, adapter_dir: Path, dest: Path, dtype: torch.dtype) -> Path:
    """Write base + adapter, merged in float32 and saved in `dtype`, to `dest` (atomically); returns dest."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from worker.model.loading import load_causal_lm

    dest = Path(dest)
    tmp = dest.parent / f".tmp-{dest.name}-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    try:
        # Merged in float32 whatever the base's dtype: W + scale * B @ A rounds once, when saved.
        base = load_causal_lm(base_model, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
        merged = merged.to(dtype)
        merged.config.dtype = dtype
        merged.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(base_model).save_pretrained(tmp)
        del base, merged
        files = {f.relative_to(tmp).as_posix(): {"sha256": file_sha256(f, fsync=True), "bytes": f.stat().st_size}
                 for f in sorted(tmp.rglob("*")) if f.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"files": files, "dtype": str(dtype).removeprefix("torch.")},
                                               indent=1))
        file_sha256(tmp / MANIFEST, fsync=True)
        fsync_dir(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def upload_merged(store, prefix: str, merged_dir: Path) -> dict:
    """Store a merged model under `prefix`: each file as merged/<name>, then merged.tar, then the manifest last;
    returns those keys' {sha256, bytes}."""
    return upload_tree(store, prefix, merged_dir, MERGED_ARCHIVE, under=MERGED_DIR)


def export_merged(store, prefix: str, base_model: str, spec_dtype: str, checkpoint_dir: Path) -> dict:
    """Merge a local LoRA checkpoint's adapter into the base, store it under the checkpoint's `prefix` and return
    the stored files (to record with the checkpoint). The local merged copy is removed afterwards."""
    dest = checkpoint_dir.parent / f".{checkpoint_dir.name}-{MERGED_DIR}"
    try:
        merge_adapter(base_model, checkpoint_dir / "adapter", dest, save_dtype(spec_dtype, base_model))
        return upload_merged(store, prefix, dest)
    finally:
        shutil.rmtree(dest, ignore_errors=True)
