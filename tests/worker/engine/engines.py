"""Engines for the engine's tests."""

from __future__ import annotations

import torch

from worker.engine.engine import Engine
from worker.engine.types import AdapterConfig


def engine_with(toy_dir, configs: dict[str, AdapterConfig], b_std: float = 0.3) -> Engine:
    """An engine with the given adapters, B drawn off zero (std b_std) so that each changes what the base
    computes."""
    engine = Engine.load(toy_dir / "model")
    for name, config in configs.items():
        engine.create(name, config)
        with torch.no_grad():
            torch.manual_seed(config.seed + 1)
            for n, p in engine.shared.model.named_parameters():
                if f"lora_B.{name}." in n:
                    p.normal_(0, b_std)
    return engine
