"""The training engine: one resident base model, any number of LoRA adapters, and per adapter the primitives
every client loop is written in (Tinker's: forward_backward, optim_step, sample, save/load state).

    engine = Engine.load(base)                      # worker/engine/engine.py
    engine.create("a", AdapterConfig(rank=8))
    out = engine.forward_backward([Pass("a", datums, "cispo", {...})])[0]   # gradients accumulate
    engine.optim_step("a", AdamParams(learning_rate=1e-4))
    engine.save_state("a", directory)               # adapter + optimizer, safetensors, sha256 manifest

Passes of several adapters given in one call run as one forward and one backward over the base, rows routed
to their adapter (worker/multi/lora.py's grouped LoRA); one adapter alone is the same code with K = 1. Sampling
(the Draw values) is not served yet: a sampler version and sample() are the next step. The losses
(worker/engine/losses.py) are pure functions of per-token log-probs; "cispo" is worker/cispo/loss.py's.

The wire types below are plain values (no torch module state), so a transport (the Tinker HTTP API's runner,
a Ray actor) can carry them.
"""

from worker.engine.types import (
    AdamParams,
    AdapterConfig,
    Datum,
    Draw,
    DrawResult,
    Pass,
    PassResult,
    SampleParams,
    Sequence,
)

__all__ = ["AdamParams", "AdapterConfig", "Datum", "Draw", "DrawResult", "Pass", "PassResult", "SampleParams",
           "Sequence"]
