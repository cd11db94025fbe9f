"""Log-probabilities of the taken tokens without a full float32 [B, T, V] logits tensor.

The LM head is applied chunk by chunk over token rows; each chunk's logits
live in float32 only inside the chunk, and under autograd the chunk is
recomputed in backward (activation checkpointing), so peak extra memory is
one chunk of logits instead of the whole batch.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _chunk(head: Callable[[Tensor], Tensor], hidden_NH: Tensor, targets_N: Tensor, temperature: float):
    logits_NV = head(hidden_NH).float()
    if temperature != 1.0:
        logits_NV = logits_NV / temperature
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
) -> tuple[Tensor, Tensor]:
    """log softmax(head(hidden) / temperature)[target] per token, and the entropy (detached).

    hidden_BTH[:, t] must be the state that predicts targets_BT[:, t].
    """
    B, T, H = hidden_BTH.shape
    hidden_NH = hidden_BTH.reshape(B * T, H)
    targets_N = targets_BT.reshape(B * T)
    use_checkpoint = torch.is_grad_enabled() and hidden_NH.requires_grad
    logps, entropies = [], []
    for start in range(0, B * T, chunk_size):
        h, t = hidden_NH[start : start + chunk_size], targets_N[start : start + chunk_size]
        if use_checkpoint:
            logp, ent = checkpoint(_chunk, head, h, t, temperature, use_reentrant=False)
        else:
            logp, ent = _chunk(head, h, t, temperature)
        logps.append(logp)
        entropies.append(ent)
    return torch.cat(logps).view(B, T), torch.cat(entropies).view(B, T).detach()
