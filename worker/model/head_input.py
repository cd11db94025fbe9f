"""The LM head's input: made contiguous for forwards that keep one position (logits_to_keep=1), or captured.

There the head's input is a non-contiguous [B, 1, H] slice of the last hidden
states, which torch.matmul turns into a bmm over the head's weight expanded B
times: a copy of B x the weight (4 x 58 MB at Qwen2.5-0.5B's 32k x 896; 2.3 s
a forward in bf16 on a CPU). Contiguous, it is one [B, H] x [H, V] matmul. In
bfloat16 the two give the same logits bit for bit; in float32 MKL rounds them
differently (~1e-6), so callers whose logits must stay bit for bit (the
rollout's) keep float32 heads as they are.

`decoder_outputs` captures that input (the decoder's normed last hidden
states) of each forward, for callers that run the head themselves on the
positions they need.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from peft import PeftModel
from torch import Tensor

__all__ = ["contiguous_head_input", "decoder_outputs"]


@contextmanager
def contiguous_head_input(model, *, float32: bool = True):
    """Within the block `model`'s LM head gets a contiguous input (with `float32` False: unless its weight is
    float32)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    skip = head is None or (not float32 and weight is not None and weight.dtype == torch.float32)
    hook = None if skip else head.register_forward_pre_hook(lambda _m, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        if hook is not None:
            hook.remove()


@contextmanager
def decoder_outputs(model):
    """A list that gets the decoder's output (last layer, normed: what the LM head reads) of every forward of
    `model` run inside the block, whatever the forward returns itself."""
    decoder = (model.get_base_model() if isinstance(model, PeftModel) else model).get_decoder()
    captured: list[Tensor] = []
    hook = decoder.register_forward_hook(
        lambda _module, _args, out: captured.append(out[0] if isinstance(out, tuple) else out.last_hidden_state))
    try:
        yield captured
    finally:
        hook.remove()
