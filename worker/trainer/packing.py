"""Sequence packing for the update (training.pack_tokens): several sequences in one row, no padding.

A padded micro-batch is as wide as its longest sequence; when lengths vary
(long-tailed completions, multi-turn episodes) most of its tokens can be
padding, each one costing a forward and a backward. Packed, the sequences
of a micro-batch sit end to end in a single row whose position ids restart
at 0 for each sequence. Given position ids and no attention mask,
transformers' masking (masking_utils, sdpa and eager alike) reads the
restarts as sequence boundaries and builds a block-diagonal causal mask, so
each token attends to its own sequence only and computes what it would
unpacked. Log-probs are handed back in the unpacked (sequence, token)
layout (worker/trainer/scoring.py), so the loss and its aggregation, the
old-policy and reference log-probs and the metrics see no difference.
"""

from __future__ import annotations

import torch

from worker.trainer.scoring import TokenBatch


def pack_rows(indices: list[int], lengths: list[int] | dict[int, int], budget: int) -> list[list[int]]:
    """The sequences `indices` grouped into rows whose lengths sum to at most `budget`, no sequence split.

    First-fit decreasing: longest first, each into the first row it fits; a sequence longer than the budget gets
    a row of its own. Like micro-batching by length, this only changes how an optimizer step's gradient is
    accumulated, not what it is.
    """
    if budget < 1:
        raise ValueError(f"budget must be positive, got {budget}")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: -lengths[i]):
        row = next((r for r, free in enumerate(room) if lengths[i] <= free), None)
        if row is None:
            rows.append([i])
            room.append(budget - lengths[i])
        else:
            rows[row].append(i)
            room[row] -= lengths[i]
    return rows


def collate_packed(token_ids: list[list[int]], action_masks: list[list[int]], *, device) -> TokenBatch:
    """One row (1, N) of the sequences end to end, each shifted for next-token scoring on its own.

    Its `sample_mask_BT` is the action mask of the same sequences right-padded (collate_sequences' layout),
    the layout sequence_logprobs returns log-probs in.
    """
    for i, (seq, mask) in enumerate(zip(token_ids, action_masks, strict=True)):
        if len(seq) != len(mask):
            raise ValueError(f"sequence {i}: {len(seq)} tokens but an action mask of {len(mask)}")
    inputs = [t for seq in token_ids for t in seq[:-1]]
    targets = [t for seq in token_ids for t in seq[1:]]
    actions = [a for mask in action_masks for a in mask[1:]]
    positions = [p for seq in token_ids for p in range(len(seq) - 1)]
    row = lambda values, dtype: torch.tensor([values], dtype=dtype, device=device)  # noqa: E731
    return TokenBatch(
        input_ids_BT=row(inputs, torch.long),
        attention_mask_BT=None,  # transformers masks by the position ids' restarts (module docstring)
        targets_BT=row(targets, torch.long),
        action_mask_BT=row(actions, torch.float32),
        position_ids_BT=row(positions, torch.long),
        sample_mask_BT=_sample_mask(action_masks).to(device),
    )


def _sample_mask(action_masks: list[list[int]]) -> torch.Tensor:
    """The targets' action mask, one right-padded row per sequence (what collate_sequences would make)."""
    out = torch.zeros((len(action_masks), max(map(len, action_masks)) - 1), dtype=torch.float32)
    for i, mask in enumerate(action_masks):
        out[i, : len(mask) - 1] = torch.tensor(mask[1:], dtype=torch.float32)
    return out
