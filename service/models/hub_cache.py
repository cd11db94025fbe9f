"""What a base model's config.json says, where it can be read without a network or torch: a local directory, or
a hub model already in the Hugging Face cache (HF_HUB_CACHE, the layout huggingface_hub writes:
models--<owner>--<name>/snapshots/<revision>/config.json)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from service.settings import Settings


def cached_config_file(model: str, cache: Path) -> Path | None:
    """The config.json of hub id `model` in the cache, if a snapshot of it holds one."""
    snapshots = cache / f"models--{model.replace('/', '--')}" / "snapshots"
    try:
        found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return None
    return found[0] if found else None


def known_config(model: str, settings: Settings) -> dict | None:
    """The model's config.json, when a local directory (already allowed by source.check_model) or the cache holds
    it; None when it is not at hand or does not parse (the dry run's model check says why)."""
    path = Path(os.path.realpath(model)) / "config.json" if model.startswith("/") else \
        cached_config_file(model, settings.resolved_hf_hub_cache())
    if path is None:
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return config if isinstance(config, dict) else None


_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def max_positions(config: dict | None) -> int | None:
    """The longest sequence the model's config says it takes (a multimodal config's text_config first)."""
    if not isinstance(config, dict):
        return None
    for section in (config.get("text_config"), config):
        if isinstance(section, dict):
            for key in _POSITION_KEYS:
                value = section.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None
