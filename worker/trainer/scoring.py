"""Token log-probabilities of rollout sequences under the current model.

A group's completions continue one prompt. With ``share_prefixes`` the
batch holds each distinct prompt once (``prefix_*``, left-padded) and every
row only what follows it: the model runs the prompts once, and each row's
forward attends to its prompt's keys and values, picked from that pass by
index (gradients flow back through them into the one prompt pass). With G
completions per prompt this saves (G - 1) prompt forwards and backwards per
group, the larger share of the work when prompts are long.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from worker.cispo import token_logprobs
from worker.model.cache_arg import CACHE_ARG
from worker.model.head_input import contiguous_head_input, decoder_outputs


@dataclass
class TokenBatch:
    """Right-padded prompt+completion sequences, aligned for next-token scoring.

    With shared prefixes, row i continues prefix ``prefix_of_B[i]`` and the
    BT tensors hold only the tokens after it. Packed (worker/trainer/packing.py),
    the BT tensors are one row of every sequence end to end, with position ids
    and no attention mask, and ``sample_mask_BT`` is the one-row-per-sequence
    layout that log-probs are returned in.
    """

    input_ids_BT: Tensor
    attention_mask_BT: Tensor | None
    targets_BT: Tensor  # input_ids shifted left by one
    action_mask_BT: Tensor  # 1 where the target is a generated token
    prefix_ids_GP: Tensor | None = None  # distinct shared prefixes, left-padded
    prefix_mask_GP: Tensor | None = None
    prefix_of_B: Tensor | None = None
    position_ids_BT: Tensor | None = None  # packed: restarting at 0 for each sequence
    sample_mask_BT: Tensor | None = None  # packed: the action mask, one right-padded row per sequence

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask_BT.sum())

    @property
    def sequence_action_mask_BT(self) -> Tensor:
        """The action mask in the layout sequence_logprobs returns: one row per sequence, right-padded."""
        return self.action_mask_BT if self.sample_mask_BT is None else self.sample_mask_BT


def collate_sequences(token_ids: list[list[int]], action_masks: list[list[int]], *, pad_id: int,
                      device, share_prefixes: bool = False, owners: list | None = None) -> TokenBatch:
    """Right-padded sequences; a target counts as an action only where the policy generated that token.

    Prompt and environment tokens are context (they feed attention) but have
    action mask 0, so the loss, a sum over action tokens, gives them exactly
    zero gradient. With `share_prefixes`, rows whose context before their
    first generated token is the same share one copy of it (see the module
    docstring), when any two rows do; with `owners` (one per row), only rows
    of one owner do (several jobs' rows on a shared base: each job's prompt
    pass goes through its own adapter).
    """
    for i, (seq, mask) in enumerate(zip(token_ids, action_masks, strict=True)):
        if len(seq) != len(mask):
            raise ValueError(f"sequence {i}: {len(seq)} tokens but an action mask of {len(mask)}")
    if share_prefixes:
        # The context's last token stays in the row: its output predicts the first generated token.
        contexts = [tuple(seq[: max(_first_action(mask) - 1, 0)]) for seq, mask in zip(token_ids, action_masks)]
        keys = list(zip(owners if owners is not None else [None] * len(contexts), contexts, strict=True))
        distinct = {key: g for g, key in enumerate(dict.fromkeys(keys))}
        if len(distinct) < len(keys) and all(contexts):
            batch = _right_padded([seq[len(c):] for seq, c in zip(token_ids, contexts)],
                                  [mask[len(c):] for mask, c in zip(action_masks, contexts)], pad_id, device)
            P = max(map(len, contexts))
            prefix_ids = torch.full((len(distinct), P), pad_id, dtype=torch.long)
            prefix_mask = torch.zeros((len(distinct), P), dtype=torch.long)
            for (_, context), g in distinct.items():
                prefix_ids[g, P - len(context):] = torch.tensor(context, dtype=torch.long)
                prefix_mask[g, P - len(context):] = 1
            batch.prefix_ids_GP, batch.prefix_mask_GP = prefix_ids.to(device), prefix_mask.to(device)
            batch.prefix_of_B = torch.tensor([distinct[k] for k in keys], dtype=torch.long, device=device)
            return batch
    return _right_padded(token_ids, action_masks, pad_id, device)


def _first_action(mask: list[int]) -> int:
    return mask.index(1) if 1 in mask else len(mask)


def _right_padded(token_ids: list[list[int]], action_masks: list[list[int]], pad_id: int, device) -> TokenBatch:
    T = max(len(ids) for ids in token_ids)
    # Whole tensors from padded nested lists: one copy each, not three small ones per row.
    ids = torch.tensor([seq + [pad_id] * (T - len(seq)) for seq in token_ids], dtype=torch.long)
    attn = torch.tensor([[1] * len(seq) + [0] * (T - len(seq)) for seq in token_ids], dtype=torch.long)
    action = torch.tensor([list(mask) + [0] * (T - len(mask)) for mask in action_masks], dtype=torch.float32)
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


def sequence_logprobs(model, batch: TokenBatch, *, temperature: float, chunk_size: int,
                      head_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(logp_BT, entropy_BT) of each action target, 0 elsewhere; logits never exist for the whole batch at once.

    Only action positions go through the LM head: prompt and environment
    targets carry no loss, and skipping them saves their share of the head's
    cost (often most of it: long prompts, short answers). The result has one
    row per sequence (batch.sequence_action_mask_BT's layout), packed or not:
    the action tokens come in the same order in both layouts.
    """
    hidden_BTH = _hidden_states(model, batch)
    action_BT = batch.action_mask_BT.bool()
    logp_1N, entropy_1N = token_logprobs(
        model.get_output_embeddings(),
        hidden_BTH[action_BT][None],
        batch.targets_BT[action_BT][None],
        temperature=temperature,
        chunk_size=chunk_size,
        head_dtype=head_dtype,  # training.lm_head_float32
    )
    sequence_action_BT = batch.sequence_action_mask_BT.bool()
    zeros_BT = logp_1N.new_zeros(sequence_action_BT.shape)
    return (zeros_BT.index_put((sequence_action_BT,), logp_1N[0]),
            zeros_BT.index_put((sequence_action_BT,), entropy_1N[0]))


def _hidden_states(model, batch: TokenBatch) -> Tensor:
    """The last layer's hidden states at the batch's positions (after the shared prefixes, if any)."""
    if batch.position_ids_BT is not None:  # packed: the position ids' restarts confine attention to each sequence
        return last_hidden(model, input_ids=batch.input_ids_BT, position_ids=batch.position_ids_BT, use_cache=False)
    if batch.prefix_ids_GP is None:
        return last_hidden(model, input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT,
                            use_cache=False)
    cache = DynamicCache(config=model.config)
    prefix_mask_GP = batch.prefix_mask_GP
    with contiguous_head_input(model):
        model(input_ids=batch.prefix_ids_GP, attention_mask=prefix_mask_GP,
              position_ids=(prefix_mask_GP.cumsum(-1) - 1).clamp(min=0), **{CACHE_ARG: cache}, use_cache=True,
              logits_to_keep=1)
    cache.batch_select_indices(batch.prefix_of_B)  # each row gets its prefix's keys and values (differentiably)
    start_B1 = prefix_mask_GP.sum(-1)[batch.prefix_of_B][:, None]
    T = batch.input_ids_BT.shape[1]
    return last_hidden(model, input_ids=batch.input_ids_BT,
                        attention_mask=torch.cat([prefix_mask_GP[batch.prefix_of_B], batch.attention_mask_BT], dim=1),
                        position_ids=start_B1 + torch.arange(T, device=start_B1.device), **{CACHE_ARG: cache},
                        use_cache=True)


def last_hidden(model, **inputs) -> Tensor:
    """The decoder's output (the last layer's hidden states, normed) of the model's own forward.

    Taken by a hook (decoder_outputs) rather than output_hidden_states=True, which would keep every layer's
    states: under no_grad (old-policy and reference scoring) that is ~17 GB more for a 7B model at 64 x 1024
    tokens. The forward still goes through the model itself (FSDP's root hooks, autocast), and logits_to_keep=1:
    the LM head runs chunked, on action positions only (sequence_logprobs)."""
    with decoder_outputs(model) as captured, contiguous_head_input(model):
        model(**inputs, logits_to_keep=1)
    return captured[-1]
