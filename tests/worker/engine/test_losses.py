"""Each loss against numbers worked out by hand on three tokens (sums over positions, Tinker's definitions)."""

from __future__ import annotations

import math

import pytest
import torch

from worker.engine.losses import loss_fn

LOGP = [-1.0, -2.0, -0.5]
OLD = [-1.0, -1.5, -1.0]  # ratios e^0 = 1, e^-0.5 = 0.6065, e^0.5 = 1.6487
ADV = [1.0, -2.0, 0.5]
RATIOS = [1.0, math.exp(-0.5), math.exp(0.5)]


def _run(name, config=None, **inputs):
    logp = torch.tensor(LOGP, requires_grad=True)
    loss, metrics = loss_fn(name)(logp, {k: torch.tensor(v) for k, v in inputs.items()}, config or {})
    loss.backward()
    return float(loss.detach()), metrics, logp.grad.tolist()


def test_cross_entropy_weighted_sum():
    loss, metrics, grad = _run("cross_entropy", weights=[1.0, 0.0, 2.0])
    assert loss == pytest.approx(1.0 + 0.0 + 1.0)
    assert metrics["loss:sum"] == pytest.approx(loss)
    assert grad == pytest.approx([-1.0, 0.0, -2.0])
    assert _run("cross_entropy")[0] == pytest.approx(3.5)  # weights default to ones


def test_importance_sampling():
    loss, _, grad = _run("importance_sampling", logprobs=OLD, advantages=ADV)
    assert loss == pytest.approx(-(1.0 - 2 * RATIOS[1] + 0.5 * RATIOS[2]))
    assert grad == pytest.approx([-r * a for r, a in zip(RATIOS, ADV)])


def test_ppo_clips_the_update():
    loss, metrics, grad = _run("ppo", logprobs=OLD, advantages=ADV)
    # token 2: A < 0, ratio 0.61 < 0.8: min(0.61 * -2, 0.8 * -2) = -1.6 (clipped: no gradient);
    # token 3: A > 0, ratio 1.65 > 1.2: min(0.82, 0.6) = 0.6 (clipped)
    assert loss == pytest.approx(-(1.0 - 1.6 + 0.6))
    assert grad == pytest.approx([-1.0, 0.0, 0.0])
    assert metrics["clipped:sum"] == 2.0


def test_cispo_clips_the_weight_only():
    loss, metrics, grad = _run("cispo", {"clip_high_threshold": 1.2}, logprobs=OLD, advantages=ADV)
    weights = [1.0, RATIOS[1], 1.2]  # no lower clip; the upper at 1.2
    assert loss == pytest.approx(-sum(w * a * lp for w, a, lp in zip(weights, ADV, LOGP)))
    assert grad == pytest.approx([-w * a for w, a in zip(weights, ADV)])  # every token keeps a gradient
    assert metrics["clipped:sum"] == 1.0


def test_cispo_zero_advantage_adds_nothing_and_refuses_a_lower_clip():
    loss, _, grad = _run("cispo", logprobs=OLD, advantages=[0.0, 0.0, 1.0])
    assert loss == pytest.approx(-RATIOS[2] * LOGP[2]) and grad[:2] == [0.0, 0.0]
    with pytest.raises(ValueError, match="clip_low_threshold"):
        _run("cispo", {"clip_low_threshold": 0.8}, logprobs=OLD, advantages=ADV)


def test_unknown_loss_names_the_served_ones():
    with pytest.raises(ValueError, match="'dpo'.*cispo, cross_entropy, importance_sampling, ppo"):
        loss_fn("dpo")
