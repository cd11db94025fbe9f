"""Sequence packing (training.pack_tokens): which sequences share a row, and the same log-probs, gradients,
optimizer steps and training metrics as padded micro-batches."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen2Config

from service.job_spec.spec import JobSpec
from tests.worker.trainer.test_scoring import groups
from tests.worker.trainer.test_update import Recording, _policy, one_step_spec
from worker.trainer.packing import collate_packed, pack_rows
from worker.trainer.scoring import collate_sequences, sequence_logprobs
from worker.trainer.update import Updater

CPU = torch.device("cpu")


def test_pack_rows_fills_rows_longest_first_within_the_budget():
    lengths = {0: 7, 1: 3, 2: 9, 3: 4, 4: 2, 5: 6, 6: 1}
    rows = pack_rows([0, 1, 2, 3, 4, 5, 6], lengths, 10)
    # first-fit decreasing: 9 | 7 | 6 | then 4 -> third row (6+4), 3 -> second (7+3), 2 -> fourth, 1 -> first (9+1)
    assert rows == [[2, 6], [0, 1], [5, 3], [4]]
    assert sorted(i for row in rows for i in row) == [0, 1, 2, 3, 4, 5, 6]  # each sequence once, whole
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)


def test_pack_rows_gives_a_sequence_over_the_budget_its_own_row():
    assert pack_rows([0, 1, 2], [12, 5, 5], 10) == [[0], [1, 2]]
    assert pack_rows([], [], 10) == []
    with pytest.raises(ValueError, match="budget"):
        pack_rows([0], [3], 0)


def test_collate_packed_restarts_positions_and_keeps_the_sequence_layout():
    batch = collate_packed([[1, 5, 6, 7], [1, 8, 9]], [[0, 0, 1, 1], [0, 1, 1]], device=CPU)
    assert batch.input_ids_BT.tolist() == [[1, 5, 6, 1, 8]]
    assert batch.targets_BT.tolist() == [[5, 6, 7, 8, 9]]
    assert batch.position_ids_BT.tolist() == [[0, 1, 2, 0, 1]]
    assert batch.action_mask_BT.tolist() == [[0, 1, 1, 1, 1]] and batch.attention_mask_BT is None
    assert batch.sequence_action_mask_BT.tolist() == [[0, 1, 1], [1, 1, 0]]  # collate_sequences' action mask


def _tiny_qwen2(attn: str):
    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def _with_lora(base):
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return model.train()


def _scored(model, batch):
    """Per-sequence action log-probs and entropies, and the LoRA gradients of their sum."""
    model.zero_grad(set_to_none=True)
    logp, entropy = sequence_logprobs(model, batch, temperature=0.8, chunk_size=16)
    mask = batch.sequence_action_mask_BT.bool()
    (logp * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [logp[i][mask[i]] for i in range(len(mask))], [entropy[i][mask[i]] for i in range(len(mask))], grads


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_score_like_padded_ones(toy_dir, arch, attn):
    """Rows of different lengths (one with an environment turn between two answers), all in one packed row, or in
    several right-padded packed rows (a shared base's micro-batch with a packing job in it): each sequence's
    log-probs, entropies and the LoRA gradients are the padded batch's, for the model types the service runs
    (Llama, Qwen2) under both attention implementations that work on a CPU."""
    base = (AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=torch.float32, attn_implementation=attn)
            if arch == "llama" else _tiny_qwen2(attn))
    model = _with_lora(base)
    seqs, masks = groups()
    seqs = [[t % 64 for t in seq] for seq in seqs]  # in the smaller model's vocabulary
    padded = collate_sequences(seqs, masks, pad_id=0, device=CPU)
    packed = collate_packed(seqs, masks, device=CPU)
    assert packed.input_ids_BT.shape == (1, sum(len(s) - 1 for s in seqs))
    rows = [1, 4, len(seqs) - 5]  # a short row, a long one, the rest: the short ones padded
    several = collate_packed(seqs, masks, device=CPU, rows=rows, pad_id=0)
    widths = [sum(len(s) - 1 for s in seqs[start : start + n]) for start, n in zip((0, 1, 5), rows)]
    assert several.input_ids_BT.shape == (3, max(widths)) and len(set(widths)) == 3
    logp_a, ent_a, grads_a = _scored(model, padded)
    for batch in (packed, several):
        logp_b, ent_b, grads_b = _scored(model, batch)
        for a, b in zip(logp_a, logp_b, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        for a, b in zip(ent_a, ent_b, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        assert grads_a.keys() == grads_b.keys() and any("lora_A" in n for n in grads_a)
        for name in grads_a:
            gap = (grads_a[name] - grads_b[name]).norm() / grads_a[name].norm()
            assert gap < 1e-5, (name, float(gap))  # float32 summation order, nothing more


def _lora_spec(toy_dir, **training) -> JobSpec:
    spec = one_step_spec(toy_dir, loss={"kl_beta": 0.1}, mini_batches=2, **training)
    return spec.model_copy(update={"lora": JobSpec.model_fields["lora"].default})


def _update(spec: JobSpec, *, asynchronous: bool):
    """The gradients each optimizer step saw, and the update's stats, on the fixed batch of 8 sequences."""
    from tests.worker.distributed.test_distributed import fixed_batch

    policy = _policy(spec)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # LoRA's B away from zero, so the A matrices get gradients too
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    rollout, advantages = fixed_batch()
    if asynchronous:  # logp_old is the sampler's own
        rollout.sampler_logprobs = [(-torch.rand(n, generator=g)).tolist() for n in rollout.action_counts]
    optimizer = Recording(policy.model.named_parameters(), lr=0.05)
    stats = Updater(policy, optimizer, spec).run(rollout, advantages, list(range(len(rollout))), step=1)
    return optimizer.seen, stats


@pytest.mark.parametrize("normalization, lora, asynchronous", [
    ("token", True, False), ("sequence", False, False), ("prompt", True, True)])
def test_packed_update_takes_the_padded_updates_steps(toy_dir, normalization, lora, asynchronous):
    """Two optimizer steps (so logp_old comes from a frozen pass, or from the sampler when asynchronous) with a
    KL penalty (a reference pass), LoRA or every weight: each gradient the optimizer sees, the losses, norms and
    metric sums are the padded update's."""
    results = []
    for pack in (None, 32):
        spec = _lora_spec(toy_dir, pack_tokens=pack)
        spec = spec.model_copy(update={
            "loss": spec.loss.model_copy(update={"normalization": normalization}),
            "rollout": spec.rollout.model_copy(update={"max_staleness": int(asynchronous)}),
            **({} if lora else {"lora": None})})
        results.append(_update(spec, asynchronous=asynchronous))
    (seen_a, stats_a), (seen_b, stats_b) = results
    assert len(seen_a) == len(seen_b) == 2
    assert any(("lora_A" if lora else "embed_tokens") in n for n in seen_a[0])
    for step_a, step_b in zip(seen_a, seen_b):
        assert step_a.keys() == step_b.keys()
        for n in step_a:  # float32 summation order; a misplaced token or advantage moves them by ~1e-2
            torch.testing.assert_close(step_b[n], step_a[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    assert stats_b.step_losses == pytest.approx(stats_a.step_losses, rel=1e-4, abs=1e-7)
    assert stats_b.grad_norms == pytest.approx(stats_a.grad_norms, rel=1e-4)
    assert stats_b.sums.keys() == stats_a.sums.keys() and stats_a.sums["kl_ref"] > 0
    for key, value in stats_a.sums.items():
        assert float(stats_b.sums[key]) == pytest.approx(float(value), rel=1e-4, abs=1e-6), key


def test_packed_update_runs_one_forward_per_row(toy_dir):
    """The fixed batch's 8 sequences (5 to 10 tokens) fit one 32-token row per mini-batch of 4: a step is one
    forward, where micro-batches of 2 take two; the frozen old-policy and reference passes are packed as well."""
    from tests.worker.trainer.conftest import forward_shapes
    from tests.worker.distributed.test_distributed import fixed_batch

    spec = _lora_spec(toy_dir, pack_tokens=32)
    policy = _policy(spec)
    rollout, advantages = fixed_batch()
    with forward_shapes(policy.model) as shapes:
        Updater(policy, Recording(policy.model.named_parameters(), lr=0.05), spec).run(
            rollout, advantages, list(range(len(rollout))))
    assert all(rows == 1 for rows, _ in shapes)
    # 2 frozen passes (old policy, reference) over the batch's packed rows, then one forward per mini-batch
    tokens = sum(len(ids) - 1 for ids in rollout.token_ids)
    assert sum(width for _, width in shapes) == 3 * tokens


def test_a_packed_job_trains_with_the_padded_jobs_first_step(toy_dir, tmp_path):
    """The whole loop with packing on: finite losses, and the first step's metrics (same rollout, same update)
    are the padded job's."""
    from tests.specs import small_spec
    from worker.trainer.loop import Trainer

    firsts = []
    for pack in (None, 64):
        trainer = Trainer(small_spec(toy_dir, steps=2, pack_tokens=pack), tmp_path / str(pack))
        first, second = trainer.train_step(), trainer.train_step()
        assert math.isfinite(first["loss"]) and math.isfinite(second["loss"])
        firsts.append(first)
    padded, packed = firsts
    for key in ("reward_mean", "loss", "kl_old", "entropy", "grad_norm", "clip_fraction", "is_ratio_p95",
                "completion_length_mean", "optimizer_steps"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-7), key
