"""Token log-probabilities of rollout sequences under the current model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from worker.cispo import token_logprobs


@dataclass
class TokenBatch:
    """Right-padded prompt+completion sequences, aligned for next-token scoring."""

    input_ids_BT: Tensor
    attention_mask_BT: Tensor
    targets_BT: Tensor  # input_ids shifted left by one
    action_mask_BT: Tensor  # 1 where the target is a generated token

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask_BT.sum())


def collate_sequences(token_ids: list[list[int]], action_masks: list[list[int]], *, pad_id: int,
                      device) -> TokenBatch:
    """Right-padded sequences; a target counts as an action only where the policy generated that token.

    Prompt and environment tokens are context (they feed attention) but have
    action mask 0, so the loss, a sum over action tokens, gives them exactly
    zero gradient.
    """
    T = max(len(ids) for ids in token_ids)
    B = len(token_ids)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    action = torch.zeros((B, T), dtype=torch.float32)
    for i, (seq, mask) in enumerate(zip(token_ids, action_masks, strict=True)):
        if len(seq) != len(mask):
            raise ValueError(f"sequence {i}: {len(seq)} tokens but an action mask of {len(mask)}")
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, : len(seq)] = 1
        action[i, : len(seq)] = torch.tensor(mask, dtype=torch.float32)
    return TokenBatch(
        input_ids_BT=ids[:, :-1].to(device),
        attention_mask_BT=attn[:, :-1].to(device),
        targets_BT=ids[:, 1:].to(device),
        action_mask_BT=action[:, 1:].to(device),
    )


def collate(prompt_ids: list[list[int]], completion_ids: list[list[int]], *, pad_id: int, device) -> TokenBatch:
    """Single-turn shorthand: every completion token is an action."""
    return collate_sequences([p + c for p, c in zip(prompt_ids, completion_ids)],
                             [[0] * len(p) + [1] * len(c) for p, c in zip(prompt_ids, completion_ids)],
                             pad_id=pad_id, device=device)


def sequence_logprobs(model, batch: TokenBatch, *, temperature: float, chunk_size: int) -> tuple[Tensor, Tensor]:
    """(logp_BT, entropy_BT) of each action target, 0 elsewhere; logits never exist for the whole batch at once.

    Only action positions go through the LM head: prompt and environment
    targets carry no loss, and skipping them saves their share of the head's
    cost (often most of it: long prompts, short answers).
    """
    out = model(
        input_ids=batch.input_ids_BT,
        attention_mask=batch.attention_mask_BT,
        output_hidden_states=True,
        logits_to_keep=1,  # the LM head runs chunked below
        use_cache=False,
    )
    hidden_BTH = out.hidden_states[-1]
    action_BT = batch.action_mask_BT.bool()
    logp_1N, entropy_1N = token_logprobs(
        model.get_output_embeddings(),
        hidden_BTH[action_BT][None],
        batch.targets_BT[action_BT][None],
        temperature=temperature,
        chunk_size=chunk_size,
    )
    zeros_BT = logp_1N.new_zeros(action_BT.shape)
    return zeros_BT.index_put((action_BT,), logp_1N[0]), zeros_BT.index_put((action_BT,), entropy_1N[0])
