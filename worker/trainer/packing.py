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


def collate_packed(token_ids: list[list[int]], action_masks: list[list[int]], *, device,
                   rows: list[int] | None = None, pad_id: int = 0) -> TokenBatch:
    """One row (1, N) of the sequences end to end, each shifted for next-token scoring on its own; with `rows` (how
    many consecutive sequences each row holds) several such rows, right-padded with `pad_id` (a shared base's
    micro-batch: one row per packed group of a job that packs, one per sequence of the others). Padding continues
    its row's positions, so it is never a sequence start, and no real token attends to it (it comes after them).

    Its `sample_mask_BT` is the action mask of the same sequences right-padded (collate_sequences' layout),
    the layout sequence_logprobs returns log-probs in.
    """
    for i, (seq, mask) in enumerate(zip(token_ids, action_masks, strict=True)):
        if len(seq) != len(mask):
            raise ValueError(f"sequence {i}: {len(seq)} tokens but an action mask of {len(mask)}")
    columns = {"inputs": [], "targets": [], "actions": [], "positions": []}
    start = 0
    for count in rows or [len(token_ids)]:
        seqs, masks = token_ids[start : start + count], action_masks[start : start + count]
        start += count
        columns["inputs"].append([t for seq in seqs for t in seq[:-1]])
        columns["targets"].append([t for seq in seqs for t in seq[1:]])
        columns["actions"].append([a for mask in masks for a in mask[1:]])
        columns["positions"].append([p for seq in seqs for p in range(len(seq) - 1)])
    if start != len(token_ids):
        raise ValueError(f"rows hold {start} sequences, not the {len(token_ids)} given")
    N = max(map(len, columns["inputs"]))

    def padded(name: str, fill, dtype) -> torch.Tensor:
        return torch.tensor([row + [fill] * (N - len(row)) for row in columns[name]], dtype=dtype, device=device)

    def continued(row: list[int]) -> list[int]:  # padding counts on from the row's last position
        after = row[-1] + 1 if row else 0
        return row + list(range(after, after + N - len(row)))

    return TokenBatch(
        input_ids_BT=padded("inputs", pad_id, torch.long),
        attention_mask_BT=None,  # transformers masks by the position ids' restarts (module docstring)
        targets_BT=padded("targets", pad_id, torch.long),
        action_mask_BT=padded("actions", 0, torch.float32),
        position_ids_BT=torch.tensor([continued(row) for row in columns["positions"]], dtype=torch.long, device=device),
        sample_mask_BT=_sample_mask(action_masks).to(device),
    )


def _sample_mask(action_masks: list[list[int]]) -> torch.Tensor:
    """The targets' action mask, one right-padded row per sequence (what collate_sequences would make)."""
    out = torch.zeros((len(action_masks), max(map(len, action_masks)) - 1), dtype=torch.float32)
    for i, mask in enumerate(action_masks):
        out[i, : len(mask) - 1] = torch.tensor(mask[1:], dtype=torch.float32)
    return out
