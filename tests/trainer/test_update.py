"""How the updater cuts a mini-batch into micro-batches."""

from __future__ import annotations

from worker.trainer.update import micro_batches


def test_micro_batches_put_similar_lengths_together():
    """Every sequence lands in exactly one micro-batch, and a short one never pads up to a long one's length."""
    lengths = {0: 10, 1: 100, 2: 12, 3: 98, 4: 50}
    chunks = micro_batches([3, 0, 4, 1, 2], lengths, 2)
    assert sorted(i for c in chunks for i in c) == [0, 1, 2, 3, 4]
    assert chunks == [[0, 2], [4, 3], [1]]
    padded = sum(max(lengths[i] for i in c) * len(c) for c in chunks)
    assert padded == 12 * 2 + 98 * 2 + 100  # in the given order it would be 98*2 + 100*2 + 12


def test_one_step_per_rollout_skips_the_frozen_forward_with_the_same_loss_and_gradient(toy_dir, tmp_path):
    """With one optimizer step per rollout, logp_old is the current pass's log-probs (detached): no frozen no-grad
    forward runs, and the step's loss and gradient are exactly those of the path that runs it."""
    import torch

    from tests.trainer.test_trainer import small_spec
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

    assert updater.reuses_current_logprobs()
    reused = updater.run(rollout, advantages, list(range(len(rollout))))
    assert frozen_calls == []
    updater.reuses_current_logprobs = lambda: False  # the frozen-forward path, on the same weights
    recomputed = updater.run(rollout, advantages, list(range(len(rollout))))
    assert frozen_calls == [1]
    assert reused.step_losses == recomputed.step_losses and reused.step_losses[0] != 0
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True))
    assert any(g.abs().sum() > 0 for g in grads[0])
