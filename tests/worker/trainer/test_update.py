"""The updater's optimizer steps against the CISPO loss written out by hand over a whole batch.

One process, the toy model, full fine-tuning (its reference is a separate frozen copy). The reference gradient
scores each sequence alone with a plain forward and log-softmax, so collation, micro-batching, the normaliser,
the advantages' placement and the sequences left out are all checked against something that has none of them.
"""

from __future__ import annotations

import pytest
import torch

from service.job_spec.spec import JobSpec
from tests.specs import job_spec
from worker.cispo.loss import k3_kl
from worker.toy.__main__ import toy_spec
from worker.trainer import plan
from worker.trainer.plan import rank_mini_batches
from worker.trainer.update import Updater, micro_batches

TEMPERATURE = 0.8
LR = 0.1


def test_micro_batches_put_similar_lengths_together():
    """Every sequence lands in exactly one micro-batch, and a short one never pads up to a long one's length."""
    lengths = {0: 10, 1: 100, 2: 12, 3: 98, 4: 50}
    chunks = micro_batches([3, 0, 4, 1, 2], lengths, 2)
    assert sorted(i for c in chunks for i in c) == [0, 1, 2, 3, 4]
    assert chunks == [[0, 2], [4, 3], [1]]
    padded = sum(max(lengths[i] for i in c) * len(c) for c in chunks)
    assert padded == 12 * 2 + 98 * 2 + 100  # in the given order it would be 98*2 + 100*2 + 12


def one_step_spec(toy_dir, *, loss=None, optimizer=None, rollout=None, **training) -> JobSpec:
    """Full fine-tuning of the toy model, one optimizer step over 2 prompts x 4, at this module's lr and temperature."""
    return job_spec(toy_spec(toy_dir), lora=None, sampling={"temperature": TEMPERATURE}, loss=loss or {},
                    optimizer={"lr": LR, **(optimizer or {})}, rollout=rollout or {},
                    training={"steps": 1, "batch_size": 2, "group_size": 4, "mini_batches": 1, "micro_batch_size": 2,
                              "logprob_chunk_size": 3, "eval_interval": 0, **training})


def _batch_without_actions_in(skipped: int):
    """The distributed tests' fixed batch of 8 sequences, sequence `skipped` with no action token (a failed reset)."""
    from tests.worker.distributed.test_distributed import fixed_batch

    rollout, advantages = fixed_batch()
    rollout.action_mask[skipped] = [0] * len(rollout.action_mask[skipped])
    rollout.action_turns[skipped] = []
    return rollout, advantages


def _naive_logp(model, rollout, i: int) -> torch.Tensor:
    """Sequence i's action-token log-probs from one unpadded forward."""
    ids = torch.tensor(rollout.token_ids[i])[None]
    logits = model(input_ids=ids).logits[0, :-1].float() / TEMPERATURE
    logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logp[torch.tensor(rollout.action_mask[i][1:], dtype=torch.bool)]


def _policy(spec):
    from worker.model.policy import load_policy

    torch.manual_seed(0)
    return load_policy(spec, resume_from=None, warm_start=None)


class Recording(torch.optim.SGD):
    """SGD that keeps each step's gradients (as the step sees them: after clipping)."""

    def __init__(self, named, **kw):
        self.named = dict(named)
        self.seen: list[dict[str, torch.Tensor]] = []
        super().__init__([p for p in self.named.values() if p.requires_grad], **kw)

    def step(self, closure=None):
        self.seen.append({n: p.grad.clone() for n, p in self.named.items() if p.grad is not None})
        return super().step(closure)


def _reference(policy, rollout, adv: dict[int, torch.Tensor], *, per_sequence=False, kl_beta=0.0, kl_clamp=10.0,
               tis_cap=None, group_size=None):
    """(loss, gradients) of the on-policy CISPO loss (weight 1) over the sequences in `adv`, in one graph; with
    `tis_cap`, each token weighed by min(exp(logp - logp_sampler), tis_cap); with `group_size`, 'prompt'
    normalisation: each prompt's tokens summed over that prompt's token count, then the mean over prompts."""
    model = policy.model
    model.train()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    total = 0.0
    tokens = sum(len(a) for a in adv.values())
    prompt_tokens: dict[int, int] = {}
    for i, a in adv.items():
        if group_size:
            prompt_tokens[i // group_size] = prompt_tokens.get(i // group_size, 0) + len(a)
    for i, a in adv.items():
        logp = _naive_logp(model, rollout, i)
        per_token = -a * logp
        if tis_cap:
            sampler = torch.tensor(rollout.sampler_logprobs[i])
            per_token = per_token * torch.exp(logp.detach() - sampler).clamp(max=tis_cap)
        if kl_beta:
            with torch.no_grad():
                ref = _naive_logp(policy.reference_model, rollout, i)
            per_token = per_token + kl_beta * k3_kl(logp, ref).clamp(max=kl_clamp)
        if group_size:
            total = total + per_token.sum() / prompt_tokens[i // group_size] / len(prompt_tokens)
        else:
            total = total + (per_token.mean() / len(adv) if per_sequence else per_token.sum() / tokens)
    grads = torch.autograd.grad(total, [dict(model.named_parameters())[n] for n in names], allow_unused=True)
    return float(total), {n: g for n, g in zip(names, grads) if g is not None}


def _assert_grads(seen: dict, want: dict, scale: float = 1.0):
    """Equal within float32 summation order: an embedding row's gradient is a scatter-add of many terms that
    cancel (seen with transformers 5.19: 5.7e-6 apart on entries of ~1e-2), hence atol 1e-5, far under the
    entries that matter (a wrong token or advantage moves them by ~1e-2)."""
    assert seen.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(seen[n], want[n] * scale, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


def test_one_step_is_the_token_mean_loss_over_the_kept_sequences(toy_dir):
    """Per-sequence advantages, 4 micro-batches of 2, one sequence left out by the caller, one without actions and
    one with a single action token:
    the step's gradient, loss, token count and gradient norm are the whole-batch loss's, clipped to max_grad_norm,
    and the step leaves no gradient behind."""
    spec = one_step_spec(toy_dir, optimizer={"max_grad_norm": 0.05})
    policy = _policy(spec)
    rollout, advantages = _batch_without_actions_in(3)
    rollout.action_mask[5] = [0] * (len(rollout.action_mask[5]) - 1) + [1]  # a one-token answer counts too
    rollout.action_turns[5] = [0]
    kept = [0, 1, 2, 4, 5, 6, 7]
    counts = rollout.action_counts
    loss, want = _reference(policy, rollout, {i: advantages[i].repeat(counts[i]) for i in kept if i != 3})
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in want.values()])))
    assert norm > 0.05 * 2  # the clip binds
    optimizer = Recording(policy.model.named_parameters(), lr=LR)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}

    stats = Updater(policy, optimizer, spec).run(rollout, advantages, [*kept, 3], step=5)

    assert len(optimizer.seen) == 1 and stats.step_losses == pytest.approx([loss], rel=1e-4)
    _assert_grads(optimizer.seen[0], want, 0.05 / norm)
    assert stats.grad_norms == pytest.approx([norm], rel=1e-4)
    assert stats.sums["tokens"] == sum(counts[i] for i in kept)
    assert all(p.grad is None for p in policy.model.parameters())
    for n, p in policy.model.named_parameters():
        if n in want:
            torch.testing.assert_close(p.detach(), before[n] - LR * want[n] * 0.05 / norm, rtol=1e-4, atol=1e-6)


def test_per_token_advantages_with_sequence_normalization_and_no_clipping(toy_dir):
    """Advantages given per action token reach their own tokens; 'sequence' normalisation means over each
    sequence's tokens, then over the sequences; max_grad_norm None leaves the gradient as it is."""
    spec = one_step_spec(toy_dir, loss={"normalization": "sequence"}, optimizer={"max_grad_norm": None},
                 micro_batch_size=3)
    policy = _policy(spec)
    rollout, _ = _batch_without_actions_in(6)
    g = torch.Generator().manual_seed(1)
    advantages = [torch.randn(n, generator=g) for n in rollout.action_counts]
    kept = [0, 1, 2, 3, 4, 5, 7]
    loss, want = _reference(policy, rollout, {i: advantages[i] for i in kept}, per_sequence=True)
    optimizer = Recording(policy.model.named_parameters(), lr=LR)

    stats = Updater(policy, optimizer, spec).run(rollout, advantages, [*kept, 6])

    assert stats.step_losses == pytest.approx([loss], rel=1e-4)
    _assert_grads(optimizer.seen[0], want)


def test_prompt_normalization_weighs_each_prompt_by_its_own_token_count(toy_dir):
    """'prompt' normalisation: a prompt's tokens over that prompt's action-token count, then the mean over the
    prompts, so a prompt with long answers weighs what one with short answers does (its two groups here have
    different token counts, one sequence left without actions)."""
    spec = one_step_spec(toy_dir, loss={"normalization": "prompt"}, optimizer={"max_grad_norm": None},
                         micro_batch_size=3)
    policy = _policy(spec)
    rollout, advantages = _batch_without_actions_in(6)
    counts = rollout.action_counts
    kept = [0, 1, 2, 3, 4, 5, 7]
    assert sum(counts[i] for i in kept[:4]) != sum(counts[i] for i in kept[4:])  # token mean and prompt mean differ
    loss, want = _reference(policy, rollout, {i: advantages[i].repeat(counts[i]) for i in kept}, group_size=4)
    optimizer = Recording(policy.model.named_parameters(), lr=LR)

    stats = Updater(policy, optimizer, spec).run(rollout, advantages, [*kept, 6])

    assert stats.step_losses == pytest.approx([loss], rel=1e-4)
    _assert_grads(optimizer.seen[0], want)


def test_kl_penalty_to_the_reference_and_the_sampler_logprobs(toy_dir):
    """With kl_beta the step adds the clamped k3 KL to the frozen reference (here a policy moved away from it);
    the sampler's own log-probs (vLLM's) land on their tokens: the truncated IS weight and the mismatch metric
    are theirs against the policy's."""
    spec = one_step_spec(toy_dir, loss={"kl_beta": 0.5, "kl_clamp": 0.02}, optimizer={"max_grad_norm": None},
                 rollout={"tis_cap": 1.05})
    policy = _policy(spec)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rollout, advantages = _batch_without_actions_in(2)
    kept = [0, 1, 3, 4, 5, 6, 7]
    with torch.no_grad():
        policy.model.eval()
        policy_logp = {i: _naive_logp(policy.model, rollout, i) for i in kept}
    g = torch.Generator().manual_seed(2)
    rollout.sampler_logprobs = [(policy_logp[i] + 0.1 * torch.randn(len(policy_logp[i]), generator=g)).tolist()
                                if i in kept else [] for i in range(len(rollout))]
    counts = rollout.action_counts
    loss, want = _reference(policy, rollout, {i: advantages[i].repeat(counts[i]) for i in kept},
                            kl_beta=0.5, kl_clamp=0.02, tis_cap=1.05)
    optimizer = Recording(policy.model.named_parameters(), lr=LR)

    stats = Updater(policy, optimizer, spec).run(rollout, advantages, kept)

    assert stats.step_losses == pytest.approx([loss], rel=1e-4)
    _assert_grads(optimizer.seen[0], want)
    assert stats.sums["kl_ref"] > 0 and stats.sums["kl_ref_clamped"] > 0 and stats.sums["tis_capped"] > 0
    mismatch = sum(float((torch.tensor(rollout.sampler_logprobs[i]) - policy_logp[i]).abs().sum()) for i in kept)
    assert stats.sums["sampler_abs_diff"] == pytest.approx(mismatch, rel=1e-4)


def test_epochs_of_mini_batches_keep_the_rollout_logprobs_frozen(toy_dir):
    """2 epochs x 2 mini-batches: four optimizer steps, each epoch over every kept token once; logp_old is the
    policy before the first step (ratio 1 there, not after), scored without dropout; the spec's ratio cap applies."""
    with pytest.warns(UserWarning, match="ratio_max"):  # a cap this low warns; here it shows the spec's cap binds
        spec = one_step_spec(toy_dir, update_epochs=2, mini_batches=2, micro_batch_size=4, loss={"ratio_max": 1.0})
    policy = _policy(spec)
    rollout, advantages = _batch_without_actions_in(0)
    kept = list(range(1, 8))
    optimizer = Recording(policy.model.named_parameters(), lr=LR)

    stats = Updater(policy, optimizer, spec).run(rollout, advantages, kept)

    assert len(optimizer.seen) == len(stats.step_losses) == len(stats.grad_norms) == 4
    assert stats.sums["tokens"] == 2 * sum(rollout.action_counts[i] for i in kept)
    first, later = stats.ratios[0], torch.cat(stats.ratios[1:])
    torch.testing.assert_close(first, torch.ones_like(first), rtol=0, atol=1e-5)
    assert (later - 1).abs().max() > 1e-3
    assert stats.sums["clipped"] == int((later > 1.0).sum()) > 0  # the spec's ratio_max, not the default 5
    assert policy.model.training


def test_mini_batches_cut_a_shuffle_keyed_by_seed_step_and_epoch(toy_dir):
    """Each epoch's mini-batches split the kept sequences between them; the cut is the same for the same seed,
    step and epoch, and another for another seed, step or epoch."""
    spec = one_step_spec(toy_dir, mini_batches=3)
    kept = [0, 1, 2, 4, 5, 6, 7]
    cuts = rank_mini_batches(spec, kept, 8, 3, 0)
    assert len(cuts) == 3 and sorted(i for c in cuts for i in c) == kept and all(cuts)
    assert rank_mini_batches(spec, kept, 8, 3, 0) == cuts
    assert rank_mini_batches(spec, kept, 8, 4, 0) != cuts
    assert rank_mini_batches(spec, kept, 8, 3, 1) != cuts
    reseeded = spec.model_copy(update={"seed": spec.seed + 1})
    assert rank_mini_batches(reseeded, kept, 8, 3, 0) != cuts
    assert len(rank_mini_batches(spec, [5, 6], 8, 3, 0)) == 2  # never more cuts than sequences


def test_each_rank_takes_its_own_sequences_of_the_same_global_cut(toy_dir, monkeypatch):
    """Two ranks of 4 sequences each (rank 1 keeps 3): every mini-batch is one cut of the 7 kept sequences, each rank
    getting its own of them as local indices, so the optimizer steps are those of one process."""
    from worker.distributed import group

    spec = one_step_spec(toy_dir, mini_batches=2)
    shares = [(4, [0, 1, 2, 3]), (4, [0, 2, 3])]
    monkeypatch.setattr(group, "gather_objects", lambda _mine: shares)
    per_rank = []
    for rank in (0, 1):
        monkeypatch.setattr(group, "rank", lambda rank=rank: rank)
        per_rank.append(rank_mini_batches(spec, shares[rank][1], 4, 2, 0))
    monkeypatch.setattr(group, "gather_objects", lambda mine: [mine])
    monkeypatch.setattr(group, "rank", lambda: 0)
    alone = rank_mini_batches(spec, [0, 1, 2, 3, 4, 6, 7], 8, 2, 0)
    for cut, on_0, on_1 in zip(alone, *per_rank, strict=True):
        assert all(0 <= i < 4 for i in on_0 + on_1)
        assert sorted(on_0 + [4 + i for i in on_1]) == sorted(cut)


def test_nothing_to_train_takes_no_step(toy_dir):
    """Only sequences without action tokens: no optimizer step, no metrics."""
    spec = one_step_spec(toy_dir)
    policy = _policy(spec)
    rollout, advantages = _batch_without_actions_in(1)
    optimizer = Recording(policy.model.named_parameters(), lr=LR)
    stats = Updater(policy, optimizer, spec).run(rollout, advantages, [1])
    assert optimizer.seen == [] and stats.step_losses == [] and stats.sums == {}


def test_zero_weight_pass_runs_a_backward_that_adds_nothing(toy_dir):
    """A rank short of micro-batches joins FSDP's collectives with a pass whose gradients are all exactly zero
    (they are added to the real ones), but that does run backward through every trainable weight."""
    spec = one_step_spec(toy_dir)
    policy = _policy(spec)
    rollout, _ = _batch_without_actions_in(1)
    Updater(policy, torch.optim.SGD(policy.trainable_parameters(), lr=LR), spec)._zero_weight_pass(rollout)
    grads = [p.grad for p in policy.trainable_parameters()]
    assert all(g is not None for g in grads) and all(not g.any() for g in grads)


def test_one_step_per_rollout_skips_the_frozen_forward_with_the_same_loss_and_gradient(toy_dir, tmp_path,
                                                                                         monkeypatch):
    """With one optimizer step per rollout, logp_old is the current pass's log-probs (detached): no frozen no-grad
    forward runs, and the step's loss and gradient are exactly those of the path that runs it."""
    import torch

    from tests.specs import small_spec
    from worker.trainer.loop import Trainer

    spec = small_spec(toy_dir, steps=1, mini_batches=1, micro_batch_size=16)
    trainer = Trainer(spec, tmp_path)
    updater = trainer.updater
    rollout = trainer.engine.generate(trainer.policy, trainer.train_rows[:4], spec.sampling, group_size=4,
                                      sampling_seeds=[11, 12, 13, 14])
    advantages = torch.linspace(-1.5, 1.5, len(rollout))
    params = trainer.policy.trainable_parameters()
    grads: list[list[torch.Tensor]] = []
    trainer.optimizer.step = lambda *a, **k: grads.append([p.grad.clone() for p in params])  # record, do not step
    frozen_calls = []
    frozen = updater._frozen_logprobs
    updater._frozen_logprobs = lambda *a, **k: frozen_calls.append(1) or frozen(*a, **k)

    assert plan.reuses_current_logprobs(spec)
    reused = updater.run(rollout, advantages, list(range(len(rollout))))
    assert frozen_calls == []
    monkeypatch.setattr(plan, "reuses_current_logprobs", lambda _spec: False)  # the frozen path, same weights
    recomputed = updater.run(rollout, advantages, list(range(len(rollout))))
    assert frozen_calls == [1]
    assert reused.step_losses == recomputed.step_losses and reused.step_losses[0] != 0
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True))
    assert any(g.abs().sum() > 0 for g in grads[0])


def _naive_entropy(model, rollout, i: int) -> torch.Tensor:
    """Sequence i's entropy (at the sampling temperature) at each action token, from one unpadded forward."""
    ids = torch.tensor(rollout.token_ids[i])[None]
    with torch.no_grad():
        logp_V = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float() / TEMPERATURE, -1)
    entropy = -(logp_V.exp() * logp_V).sum(-1)
    return entropy[torch.tensor(rollout.action_mask[i][1:], dtype=torch.bool)]


def test_each_epoch_trains_the_cut_of_its_own_step_and_epoch(toy_dir):
    """run() hands its step and each epoch to the shuffle: the sequences of every optimizer step are exactly the
    mini-batch cut for that (seed, step, epoch), so a resumed job at step S trains what the first run did."""
    spec = one_step_spec(toy_dir, update_epochs=2, mini_batches=2, micro_batch_size=1)
    policy = _policy(spec)
    rollout, advantages = _batch_without_actions_in(0)
    kept = list(range(1, 8))
    updater = Updater(policy, Recording(policy.model.named_parameters(), lr=LR), spec)
    trained: list[list[int]] = [[]]
    batch = updater._batch
    # the batches the training passes collate (the frozen logp_old pass runs in eval mode and is left out)
    updater._batch = lambda r, idx: (policy.model.training and trained[-1].extend(idx)) or batch(r, idx)  # noqa: E731
    step = updater.optimizer.step
    updater.optimizer.step = lambda *a: trained.append([]) or step(*a)  # noqa: E731

    updater.run(rollout, advantages, kept, step=6)

    want = [sorted(cut) for epoch in (0, 1) for cut in rank_mini_batches(spec, kept, 8, 6, epoch)]
    assert [sorted(t) for t in trained[:-1]] == want
    assert want != [sorted(cut) for epoch in (0, 1) for cut in rank_mini_batches(spec, kept, 8, 0, epoch)]
    assert want[:2] != want[2:]  # the second epoch is cut anew


def test_a_single_action_token_is_a_step_and_the_entropy_is_the_token_mean(toy_dir):
    """A mini-batch of one one-token answer (normaliser exactly 1) still takes its optimizer step; the entropy
    metric is the mean over the trained action tokens of the sampling distribution's entropy."""
    spec = one_step_spec(toy_dir)
    policy = _policy(spec)
    rollout, advantages = _batch_without_actions_in(3)
    rollout.action_mask[5] = [0] * (len(rollout.action_mask[5]) - 1) + [1]
    rollout.action_turns[5] = [0]
    optimizer = Recording(policy.model.named_parameters(), lr=LR)
    policy.model.train()
    want_entropy = float(_naive_entropy(policy.model, rollout, 5).mean())

    stats = Updater(policy, optimizer, spec).run(rollout, advantages, [5])

    assert len(optimizer.seen) == 1 and stats.sums["tokens"] == 1
    assert stats.metrics()["entropy"] == pytest.approx(want_entropy, rel=1e-4)
    kept = [0, 1, 2, 4, 6, 7]
    many = Updater(_policy(spec), Recording(policy.model.named_parameters(), lr=LR), spec).run(rollout, advantages, kept)
    tokens = sum(rollout.action_counts[i] for i in kept)
    fresh = _policy(spec).model
    fresh.train()
    want_mean = float(sum(_naive_entropy(fresh, rollout, i).sum() for i in kept) / tokens)
    assert many.metrics()["entropy"] == pytest.approx(want_mean, rel=1e-4)


def test_asynchronous_rollouts_take_logp_old_from_the_sampler(toy_dir):
    """At max_staleness 1 (the least asynchronous setting) logp_old is the sampler's own log-probs: no frozen
    forward recomputes them under the current policy, and a rollout without them is refused."""
    spec = one_step_spec(toy_dir, update_epochs=2, rollout={"max_staleness": 1})
    policy = _policy(spec)
    rollout, advantages = _batch_without_actions_in(3)
    kept = [0, 1, 2, 4, 5, 6, 7]
    updater = Updater(policy, Recording(policy.model.named_parameters(), lr=LR), spec)
    rollout.sampler_logprobs = None
    with pytest.raises(ValueError, match="^rollout.max_staleness > 0 needs the sampler's log-probs of every sequence$"):
        updater.run(rollout, advantages, kept)
    rollout.sampler_logprobs = [[-1.0] * count for count in rollout.action_counts]
    frozen = []
    updater._frozen_logprobs = lambda *a, **kw: frozen.append(kw) or {}  # noqa: E731
    stats = updater.run(rollout, advantages, kept)
    assert frozen == [] and len(stats.step_losses) == 2


def test_the_update_s_mlps_recompute_their_activation_and_are_restored_after(toy_dir):
    """The update runs its forwards with recomputed SwiGLU MLPs (worker/model/lean_backward.py: one MLP-width tensor
    less kept per layer), and the model's own MLPs afterwards."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    spec = one_step_spec(toy_dir)
    policy = _policy(spec)
    rollout, advantages = _batch_without_actions_in(3)
    mlps = [m for m in policy.model.modules() if isinstance(m, LlamaMLP)]
    patched: list[bool] = []
    hooks = [m.register_forward_hook(lambda m, _a, _o: patched.append("forward" in m.__dict__)) for m in mlps]
    Updater(policy, Recording(policy.model.named_parameters(), lr=LR), spec).run(rollout, advantages, [0, 1, 2])
    for hook in hooks:
        hook.remove()
    assert patched and all(patched)
    assert not any("forward" in m.__dict__ for m in mlps)
