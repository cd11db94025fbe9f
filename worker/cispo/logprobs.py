"""Log-probabilities of the taken tokens without a full float32 [B, T, V] logits tensor.

The LM head is applied chunk by chunk over token rows, so float32 logits
exist for one chunk at a time, in the forward pass and again in backward.

For a plain linear head (the usual case: LoRA leaves the LM head alone) a
custom autograd function does this with the closed-form gradient
d logp / d logits = onehot(target) - softmax(logits): backward recomputes
each chunk's logits once (and turns them into the softmax in place, with
the forward's row max and exp-sum: two floats a row) and nothing of size V
is saved between the passes.
Any other head (say, one with its own adapter) goes through activation
checkpointing per chunk, which is slower but equally frugal.

Logits are float32 after the head in every case (a float64 plain linear
head keeps float64, so the function can be gradchecked), but under a bf16 autocast
the head's matmul itself runs in bf16, so each logit is rounded to bf16's
8 bits before the softmax. ``head_dtype=torch.float32`` (the spec's
training.lm_head_float32, ScaleRL's FP32 logits) runs the plain linear head's
matmul, forward and backward, in float32 instead.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _scaled_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """float32 (float64 for a float64 head) logits / temperature of one chunk, in a fresh tensor the caller may
    overwrite."""
    logits = torch.nn.functional.linear(h, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits if temperature == 1.0 else logits.div_(temperature)


def _chunk_stats_(logits_NV: Tensor, targets_N: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp of the targets, entropy, row max, sum of exp(logits - max)) of float32 logits already divided by
    temperature; log Z = max + log(sum), but backward needs max and sum apart (see there).

    Overwrites `logits_NV` (shifted by each row's max) and allocates one more tensor of its size: these
    passes over [chunk, vocab] cost as much as the head's matmul at a 32k vocabulary on a CPU.
    """
    max_N1 = logits_NV.amax(-1, keepdim=True)
    shifted_NV = logits_NV.sub_(max_N1)
    exp_NV = shifted_NV.exp()
    sum_N = exp_NV.sum(-1)
    log_sum_N = sum_N.log()
    logp_N = shifted_NV.gather(-1, targets_N[:, None]).squeeze(-1) - log_sum_N
    # vecdot is on autocast's lower-precision list: under a bf16 autocast it would round E_p[logits] to bf16
    with torch.autocast(logits_NV.device.type, enabled=False):
        expected_shifted_N = torch.linalg.vecdot(exp_NV, shifted_NV) / sum_N
    entropy_N = log_sum_N - expected_shifted_N  # log Z - E_p[logits], shift-free
    return logp_N, entropy_N, max_N1.squeeze(-1), sum_N


class _LinearHeadLogprobs(torch.autograd.Function):
    """Chunked log_softmax(h @ W^T + b)[target] with its exact gradient and no saved logits."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, targets_N, temperature: float, chunk_size: int,
                head_dtype: torch.dtype | None = None):
        # Backward runs outside autocast: it redoes the head's matmuls in the dtype the forward ran them in
        # (bf16 under a bf16 autocast, not float32 master weights at a fraction of the speed).
        device = hidden_NH.device.type
        ctx.compute_dtype = head_dtype or (torch.get_autocast_dtype(device)
                                           if torch.is_autocast_enabled(device) else weight_VH.dtype)
        weight, bias = weight_VH, bias_V
        if head_dtype is not None:  # the matmul in head_dtype, whatever autocast is on
            weight = weight_VH.to(head_dtype)
            bias = bias_V.to(head_dtype) if bias_V is not None else None
        logps, entropies, maxes, sums = [], [], [], []
        with torch.autocast(device, enabled=False) if head_dtype is not None else nullcontext():
            for s in range(0, hidden_NH.shape[0], chunk_size):
                h = hidden_NH[s : s + chunk_size]
                logits = _scaled_logits(h if head_dtype is None else h.to(head_dtype), weight, bias, temperature)
                logp, entropy, row_max, exp_sum = _chunk_stats_(logits, targets_N[s : s + chunk_size])
                logps.append(logp)
                entropies.append(entropy)
                maxes.append(row_max)
                sums.append(exp_sum)
        # Each row's max and exp-sum (two floats a row) let backward turn its recomputed logits into softmax in place.
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, targets_N, torch.cat(maxes), torch.cat(sums))
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        entropy_N = torch.cat(entropies)
        ctx.mark_non_differentiable(entropy_N)
        return torch.cat(logps), entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N, _grad_entropy):
        hidden_NH, weight_VH, bias_V, targets_N, max_N, sum_N = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden_NH) if need_h else None
        accum = torch.promote_types(weight_VH.dtype, torch.float32)
        grad_w = torch.zeros_like(weight_VH, dtype=accum) if need_w else None
        grad_b = torch.zeros_like(bias_V, dtype=accum) if need_b and bias_V is not None else None
        dtype = ctx.compute_dtype
        weight = weight_VH.to(dtype)  # once, not per chunk (a no-op in float32)
        bias = bias_V.to(dtype) if bias_V is not None else None
        for s in range(0, hidden_NH.shape[0], ctx.chunk_size):
            e = s + ctx.chunk_size
            h = hidden_NH[s:e].to(dtype)
            # d logp / d logits = (onehot - softmax) * incoming gradient / T, built in the logits' own storage:
            # softmax = exp(logits - max) / sum, with max and sum from the forward (the same matmul, the same logits).
            # Not exp(logits - log Z): log Z rounded to float32 is off by up to half an ulp of the max logit, which
            # shifts every probability of the row and leaves rows summing to 1 +- a few 1e-7 at logits near 30.
            scale_N1 = grad_logp_N[s:e, None].to(sum_N.dtype) / ctx.temperature
            g_NV = _scaled_logits(h, weight, bias, ctx.temperature).sub_(max_N[s:e, None]).exp_()
            g_NV.mul_(-scale_N1 / sum_N[s:e, None])
            g_NV.scatter_add_(-1, targets_N[s:e, None], scale_N1)
            g = g_NV.to(dtype)
            if need_h:
                grad_h[s : s + ctx.chunk_size] = (g @ weight).to(hidden_NH.dtype)
            if need_w:
                grad_w += (g.T @ h).to(accum)  # summed over chunks in float32 (or float64)
            if grad_b is not None:
                grad_b += g_NV.sum(0)
        grad_w = grad_w.to(weight_VH.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias_V.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None


def _checkpointed_chunk(head: Callable[[Tensor], Tensor], hidden_NH: Tensor, targets_N: Tensor, temperature: float):
    logits_NV = head(hidden_NH).float() / temperature
    log_z_N = torch.logsumexp(logits_NV, dim=-1)
    logp_N = logits_NV.gather(-1, targets_N[:, None]).squeeze(-1) - log_z_N
    with torch.no_grad():  # entropy is a metric only
        probs_NV = torch.softmax(logits_NV, dim=-1)
        entropy_N = log_z_N - (probs_NV * logits_NV).sum(-1)
    return logp_N, entropy_N


def token_logprobs(
    head: Callable[[Tensor], Tensor],
    hidden_BTH: Tensor,
    targets_BT: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    head_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """log softmax(head(hidden) / temperature)[target] per token, and the entropy (detached).

    hidden_BTH[:, t] must be the state that predicts targets_BT[:, t]. ``head_dtype``: the dtype of a plain
    linear head's matmul (None: autocast's, or the weights'); other heads ignore it.
    """
    B, T, H = hidden_BTH.shape
    hidden_NH = hidden_BTH.reshape(B * T, H)
    targets_N = targets_BT.reshape(B * T)
    if type(head) is torch.nn.Linear:
        logp_N, entropy_N = _LinearHeadLogprobs.apply(hidden_NH, head.weight, head.bias, targets_N, temperature,
                                                      chunk_size, head_dtype)
        return logp_N.view(B, T), entropy_N.view(B, T).detach()
    use_checkpoint = torch.is_grad_enabled() and hidden_NH.requires_grad
    logps, entropies = [], []
    for start in range(0, B * T, chunk_size):
        h, t = hidden_NH[start : start + chunk_size], targets_N[start : start + chunk_size]
        if use_checkpoint:
            logp, ent = checkpoint(_checkpointed_chunk, head, h, t, temperature, use_reentrant=False)
        else:
            logp, ent = _checkpointed_chunk(head, h, t, temperature)
        logps.append(logp)
        entropies.append(ent)
    return torch.cat(logps).view(B, T), torch.cat(entropies).view(B, T).detach()
