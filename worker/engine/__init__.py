"""The training engine: one resident base model, any number of LoRA adapters, and per adapter the primitives
every client loop is written in (Tinker's: forward_backward, optim_step, sample, save/load state).

    engine = Engine.load(base)                      # worker/engine/engine.py
    engine.create("a", AdapterConfig(rank=8))
    out = engine.forward_backward([Pass("a", datums, "cispo", {...})])[0]   # gradients accumulate
    engine.optim_step("a", AdamParams(learning_rate=1e-4))
    engine.save_state("a", directory)               # adapter + optimizer, safetensors, sha256 manifest
    engine.save_for_sampler("a", "a@1")             # a frozen copy of the weights (or load_sampler(v, directory))
    results = engine.sample([Draw("a@1", prompt, 4, SampleParams(max_tokens=64, seed=0))])  # tokens + log-probs

Passes of several adapters given in one call run as one forward and one backward over the base, rows routed
to their adapter (worker/multi/lora.py's grouped LoRA); one adapter alone is the same code with K = 1. Draws
likewise: every draw of a sample() call decodes in one loop over the base (worker/rollout/decode.py), each row
through its source (an adapter's live weights, a sampler version, or the base alone), with the sampler's
log-probs (at temperature 1 exactly what forward_backward scores) and, when asked, the prompt's; what the
sampling knobs mean is worker/engine/draws.py's docstring. The losses (worker/engine/losses.py) are pure
functions of per-token log-probs; "cispo" is worker/cispo/loss.py's.

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
