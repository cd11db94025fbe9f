"""Loading a causal LM the way the worker runs it."""

from __future__ import annotations


def load_causal_lm(where, **kwargs):
    """AutoModelForCausalLM.from_pretrained with transformers' hub kernels off. From transformers 5.25 they are on
    by default: from_pretrained fetches kernel code from the hub, and every train() and eval() swaps the forwards of
    the layers they cover, under the worker's own swaps (worker/model/optional_swaps.py). The worker runs the
    model's own code, the code the tests ran."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(where, use_kernels=False, **kwargs)
