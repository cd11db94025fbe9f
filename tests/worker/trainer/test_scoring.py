"""Scoring with shared prompt prefixes: the same log-probs and the same gradients as scoring every row whole."""

from __future__ import annotations

import pytest
import torch

from tests.worker.trainer.conftest import forward_shapes
from worker.trainer.scoring import collate_sequences, sequence_logprobs

PAD = 0
CPU = torch.device("cpu")


def groups() -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts of different lengths, each with completions of different lengths; the middle one also has
    an environment turn (mask 0) between two actions, as multi-turn episodes do."""
    g = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(4, 40, (n,), generator=g).tolist()  # noqa: E731
    seqs, masks = [], []
    for prompt_len, completions in ((5, (3, 7, 1)), (9, (4, 4)), (2, (6, 2, 5, 3))):
        prompt = [1] + rand(prompt_len)
        for n in completions:
            action = rand(n)
            if prompt_len == 9:  # action, environment turn, action
                seqs.append(prompt + action + [3, 3] + action)
                masks.append([0] * len(prompt) + [1] * n + [0, 0] + [1] * n)
            else:
                seqs.append(prompt + action)
                masks.append([0] * len(prompt) + [1] * n)
    return seqs, masks


def score(model, batch):
    model.zero_grad(set_to_none=True)
    logp, entropy = sequence_logprobs(model, batch, temperature=0.8, chunk_size=16)
    mask = batch.action_mask_BT.bool()
    per_token = [logp[i][mask[i]] for i in range(len(logp))]
    (logp * batch.action_mask_BT).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return per_token, [entropy[i][mask[i]] for i in range(len(logp))], grads


def test_shared_prefixes_give_the_same_logprobs_and_gradients(lora_model):
    seqs, masks = groups()
    whole = collate_sequences(seqs, masks, pad_id=PAD, device=CPU)
    shared = collate_sequences(seqs, masks, pad_id=PAD, device=CPU, share_prefixes=True)
    assert whole.prefix_ids_GP is None
    assert shared.prefix_ids_GP.shape[0] == 3 and shared.prefix_of_B.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert shared.input_ids_BT.shape[1] < whole.input_ids_BT.shape[1]  # the rows no longer carry their prompt
    lora_model.train()
    logp_a, ent_a, grads_a = score(lora_model, whole)
    logp_b, ent_b, grads_b = score(lora_model, shared)
    for a, b in zip(logp_a, logp_b, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    for a, b in zip(ent_a, ent_b, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and any("lora_A" in n for n in grads_a)
    for name in grads_a:
        gap = (grads_a[name] - grads_b[name]).norm() / grads_a[name].norm()
        assert gap < 1e-5, (name, float(gap))  # float32 summation order, nothing more


def test_prefix_pass_runs_once_per_distinct_prompt(lora_model):
    seqs, masks = groups()
    shared = collate_sequences(seqs, masks, pad_id=PAD, device=CPU, share_prefixes=True)
    with forward_shapes(lora_model) as rows, torch.no_grad():
        sequence_logprobs(lora_model, shared, temperature=1.0, chunk_size=16)
    assert rows == [tuple(shared.prefix_ids_GP.shape), tuple(shared.input_ids_BT.shape)]


def test_nothing_is_shared_when_no_two_rows_share_a_prompt():
    seqs = [[1, 5, 6, 7, 8], [1, 9, 6, 7, 8]]
    masks = [[0, 0, 0, 1, 1]] * 2
    batch = collate_sequences(seqs, masks, pad_id=PAD, device=CPU, share_prefixes=True)
    assert batch.prefix_ids_GP is None and batch.input_ids_BT.tolist() == [[1, 5, 6, 7], [1, 9, 6, 7]]


def test_scoring_keeps_only_the_last_hidden_state(lora_model):
    """No forward asks for every layer's hidden states (a 7B model's no-grad scoring would keep ~17 GB more), and
    the log-probs are those of the last layer's states, with and without shared prefixes."""
    seqs, masks = groups()
    seen = []
    hook = lora_model.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(kwargs.get("output_hidden_states")),
                                                with_kwargs=True)
    try:
        with torch.no_grad():
            results = [sequence_logprobs(lora_model, collate_sequences(seqs, masks, pad_id=PAD, device=CPU,
                                                                       share_prefixes=shared),
                                         temperature=0.8, chunk_size=16)[0] for shared in (False, True)]
    finally:
        hook.remove()
    assert seen and not any(seen), seen
    whole = collate_sequences(seqs, masks, pad_id=PAD, device=CPU)
    with torch.no_grad():
        out = lora_model(input_ids=whole.input_ids_BT, attention_mask=whole.attention_mask_BT,
                         output_hidden_states=True)
        expected = torch.log_softmax(out.logits / 0.8, dim=-1).gather(-1, whole.targets_BT[..., None]).squeeze(-1)
    mask = whole.action_mask_BT.bool()
    assert torch.allclose(results[0][mask], expected[mask], atol=1e-5)
    assert torch.allclose(results[0][mask].sum(), results[1].sum(), atol=1e-4)  # shared prefixes: same values


def test_collate_right_pads_and_shifts_targets_by_one():
    """input_ids drop the last token, targets the first; padding has attention 0, the pad id and no action."""
    from worker.trainer.scoring import collate

    batch = collate([[1, 7, 8], [1, 9]], [[20, 21], [22]], pad_id=PAD, device=CPU)
    assert batch.input_ids_BT.tolist() == [[1, 7, 8, 20], [1, 9, 22, PAD]]
    assert batch.targets_BT.tolist() == [[7, 8, 20, 21], [9, 22, PAD, PAD]]
    assert batch.attention_mask_BT.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch.action_mask_BT.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert batch.action_mask_BT.dtype == torch.float32 and batch.input_ids_BT.dtype == torch.long
    assert batch.num_action_tokens == 3 and batch.prefix_ids_GP is None


def test_a_mask_of_another_length_is_refused():
    with pytest.raises(ValueError, match=r"sequence 1: 3 tokens but an action mask of 2"):
        collate_sequences([[1, 2, 3], [1, 2, 3]], [[0, 1, 1], [0, 1]], pad_id=PAD, device=CPU)


def test_shared_prefixes_are_left_padded_and_rows_keep_the_context_s_last_token():
    """Two prompts of different lengths: each is stored once, left-padded; each row starts with its prompt's last
    token (whose output predicts the first action)."""
    seqs = [[1, 5, 6, 30, 31], [1, 5, 6, 32], [1, 7, 40, 41]]
    masks = [[0, 0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 1, 1]]
    batch = collate_sequences(seqs, masks, pad_id=PAD, device=CPU, share_prefixes=True)
    assert batch.prefix_ids_GP.tolist() == [[1, 5], [PAD, 1]]
    assert batch.prefix_mask_GP.tolist() == [[1, 1], [0, 1]]
    assert batch.prefix_of_B.tolist() == [0, 0, 1]
    assert batch.input_ids_BT.tolist() == [[6, 30], [6, 32], [7, 40]]
    assert batch.targets_BT.tolist() == [[30, 31], [32, PAD], [40, 41]]
    assert batch.action_mask_BT.tolist() == [[1, 1], [1, 0], [1, 1]]
    assert batch.prefix_ids_GP.dtype == batch.prefix_mask_GP.dtype == batch.prefix_of_B.dtype == torch.long


@pytest.mark.parametrize("first", [[0, 1, 1, 1], [1, 1, 1, 1]])
def test_nothing_is_shared_when_a_row_has_no_context_before_its_last_prompt_token(first):
    """A row whose first action is its second token (or its first) has no prefix to share: the batch is whole."""
    seqs = [[1, 20, 21, 22], [1, 5, 6, 30], [1, 5, 6, 31]]
    masks = [first, [0, 0, 0, 1], [0, 0, 0, 1]]
    batch = collate_sequences(seqs, masks, pad_id=PAD, device=CPU, share_prefixes=True)
    assert batch.prefix_ids_GP is None and batch.input_ids_BT.tolist() == [s[:-1] for s in seqs]


def test_fewer_masks_than_sequences_are_refused():
    with pytest.raises(ValueError, match="shorter|longer"):
        collate_sequences([[1, 2, 3], [1, 2, 3]], [[0, 1, 1]], pad_id=PAD, device=CPU)


def test_a_row_without_action_tokens_is_collated_beside_shared_prefixes():
    """A failed reset leaves a row with no generated token: it shares nothing, trains nothing, and does not stop
    the other rows sharing their prompt."""
    seqs = [[1, 5, 6, 30, 31], [1, 5, 6, 32], [1, 7, 8, 9]]
    masks = [[0, 0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
    batch = collate_sequences(seqs, masks, pad_id=PAD, device=CPU, share_prefixes=True)
    assert batch.prefix_of_B.tolist() == [0, 0, 1]
    assert batch.action_mask_BT[2].sum().item() == 0 and batch.num_action_tokens == 3


def test_the_lm_head_runs_in_the_head_dtype_under_bf16_autocast(lora_model):
    """training.lm_head_float32: with the body under bfloat16 autocast, head_dtype float32 gives the float32 head's
    log-probs of the body's hidden states; without it the head runs in bfloat16 (visibly different)."""
    from worker.trainer.scoring import _hidden_states

    seqs, masks = groups()
    batch = collate_sequences(seqs, masks, pad_id=PAD, device=CPU)
    mask = batch.action_mask_BT.bool()
    runs = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden_NH = _hidden_states(lora_model, batch)[mask]
        for head in (None, torch.float32):
            runs[head] = sequence_logprobs(lora_model, batch, temperature=0.8, chunk_size=16, head_dtype=head)[0][mask]
    logits_NV = hidden_NH.float() @ lora_model.get_output_embeddings().weight.float().T / 0.8
    want = torch.log_softmax(logits_NV, -1).gather(-1, batch.targets_BT[mask][:, None]).squeeze(-1)
    torch.testing.assert_close(runs[torch.float32], want, rtol=0, atol=1e-4)
    assert (runs[None] - want).abs().max() > 1e-3


@pytest.mark.parametrize("shared", [False, True])
def test_the_discarded_head_gets_a_contiguous_input(lora_model, shared):
    """Scoring's forwards keep one position for the LM head, whose output is thrown away; its input, a [B, 1, H]
    slice, is made contiguous so that torch.matmul runs one matmul instead of copying the head's weight B times
    (2.3 s a forward in bf16 at Qwen2.5-0.5B's shape on a CPU). The hook is gone afterwards."""
    seqs, masks = groups()
    head = lora_model.get_output_embeddings()
    seen = []
    hook = head.register_forward_hook(lambda _m, args, _out: seen.append((args[0].dim(), args[0].is_contiguous())))
    try:
        with torch.no_grad():
            sequence_logprobs(lora_model, collate_sequences(seqs, masks, pad_id=PAD, device=CPU, share_prefixes=shared),
                              temperature=1.0, chunk_size=16)
    finally:
        hook.remove()
    assert seen and all(contiguous for _dim, contiguous in seen), seen
    assert not head._forward_pre_hooks
