"""The recipe knobs' pure math against hand-computed numbers: batch-level advantages, prompt-level aggregation,
token/sequence importance ratios, AgileRL's off-policy masks and the pass-rate filter.

The loss cases reuse tests/worker/cispo/test_loss.py's small case (ratio [[8, 1, 10], [1/8, 2, 1]], the third token
of row 0 masked, A = [1, -2]), whose per-token terms -w*A*logp are [[5, 2, -], [-0.0625, -6, -6]].
"""

from __future__ import annotations

import math

import torch

from tests.worker.cispo.test_loss import _close, _small_case
from worker.cispo import group_advantages, prompts_to_retire, sequence_weights
from worker.cispo.loss import cispo_loss
from worker.cispo.off_policy import log_importance_ratio, sequence_mask_keep, token_band_keep


def test_batch_std_divides_by_the_whole_batchs_reward_std():
    """Rewards [1,0,0,1] and [2,2,2,2]: batch mean 1.25, variance (2*0.0625 + 2*1.5625 + 4*0.5625)/8 = 0.6875."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv, zero = group_advantages(rewards, scale="batch_std", eps=0.0)
    expected = 0.5 / math.sqrt(0.6875)
    _close(adv[0], [expected, -expected, -expected, expected], atol=1e-6)
    assert adv[1].tolist() == [0.0] * 4 and zero.tolist() == [False, True]
    grouped, _ = group_advantages(rewards, scale="group_std", eps=0.0)  # the group's own std 0.5: unit size
    _close(grouped[0], [1.0, -1.0, -1.0, 1.0], atol=1e-6)
    given, _ = group_advantages(rewards, scale="batch_std", eps=0.0, batch_std=2.0)  # other ranks' rewards too
    _close(given[0], [0.25, -0.25, -0.25, 0.25], atol=1e-6)


def test_batch_std_adds_eps_to_the_std():
    """Rewards [0, 1] and [0, 3]: centred [-0.5, 0.5], [-1.5, 1.5]; batch std sqrt(1.5); eps 0.5 is added to it,
    given or measured."""
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0]])
    given, _ = group_advantages(rewards, scale="batch_std", eps=0.5, batch_std=2.0)
    _close(given, [[-0.2, 0.2], [-0.6, 0.6]], atol=1e-6)
    measured, _ = group_advantages(rewards, scale="batch_std", eps=0.5)
    d = math.sqrt(1.5) + 0.5
    _close(measured, [[-0.5 / d, 0.5 / d], [-1.5 / d, 1.5 / d]], atol=1e-6)


def test_sequence_weights_per_level():
    counts, prompts = [2, 4, 3, 1], [0, 0, 1, 1]
    assert sequence_weights("token", counts, prompts) == ([1.0] * 4, 10.0)
    assert sequence_weights("sequence", counts, prompts) == ([0.5, 0.25, 1 / 3, 1.0], 4.0)
    assert sequence_weights("prompt", counts, prompts) == ([1 / 6, 1 / 6, 1 / 4, 1 / 4], 2.0)


def test_prompt_level_loss_hand_computed():
    """Sequence sums 7 and -12.0625. One prompt: (7 - 12.0625) / 5 tokens, the token mean. Two prompts:
    (7/2 + -12.0625/3) / 2."""
    _, inputs = _small_case()
    one = cispo_loss(inputs, normalizer=1.0, sequence_weights_B=torch.tensor([0.2, 0.2], dtype=torch.float64))
    _close(one.loss, -1.0125)
    two = cispo_loss(inputs, normalizer=2.0, sequence_weights_B=torch.tensor([0.5, 1 / 3], dtype=torch.float64))
    _close(two.loss, (3.5 - 12.0625 / 3) / 2)
    weights, n = sequence_weights("sequence", [2, 3], [0, 1])  # the same weights as per_sequence=True
    by_weights = cispo_loss(inputs, normalizer=n, sequence_weights_B=torch.tensor(weights, dtype=torch.float64))
    _close(by_weights.loss, cispo_loss(inputs, normalizer=2.0, per_sequence=True).loss)


def test_sequence_level_ratio_is_the_geometric_mean_over_action_tokens():
    """Row 0: mean(ln 8, 0) -> 2^1.5; row 1: mean(-3 ln2, ln2, 0) -> 2^(-2/3); each under the cap of 5."""
    logp, inputs = _small_case()
    out = cispo_loss(inputs, normalizer=5.0, importance_sampling_level="sequence")
    w0, w1 = 2**1.5, 2 ** (-2 / 3)
    _close(out.loss, (w0 * 1 * (1.0 + 2.0) + w1 * -2 * (0.25 + 1.5 + 3.0)) / 5)
    _close(out.ratio_N, [w0, w0, w1, w1, w1])
    log_ratio = torch.tensor([[1.0, 3.0, 100.0]])
    _close(log_importance_ratio(log_ratio, torch.tensor([[1, 1, 0]]), "sequence"), [[2.0, 2.0, 2.0]])


def test_token_band_drops_tokens_outside_it_with_zero_gradient():
    """Band (0.5, 5): ratios 8 and 1/8 are dropped, leaving 2 - 6 - 6 over the step's 5 tokens."""
    logp, inputs = _small_case()
    out = cispo_loss(inputs, normalizer=5.0, token_mask_bounds=(0.5, 5.0))
    _close(out.loss, -2.0)
    assert out.sums["off_policy_masked"].item() == 2.0 and out.sums["tokens"].item() == 5.0
    out.loss.backward()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[1, 0].item() == 0.0
    _close(logp.grad[0, 1], -1.0 / 5)  # -w*A = -1*1, divided by the 5 tokens
    assert token_band_keep(torch.tensor([0.4, 0.5, 5.0, 5.1]), (0.5, 5.0)).tolist() == [False, True, True, False]


def test_sequence_mask_drops_negative_advantage_tokens_of_drifted_sequences():
    """Row 1's mean log(old/new) is 2 ln2 / 3 = 0.462 and its advantage is -2: above a threshold of 0.3 its three
    tokens are dropped, leaving row 0's 5 + 2; at 0.5 nothing is."""
    _, inputs = _small_case()
    _close(cispo_loss(inputs, normalizer=5.0, sequence_mask_threshold=0.3).loss, 7.0 / 5)
    _close(cispo_loss(inputs, normalizer=5.0, sequence_mask_threshold=0.5).loss, -1.0125)
    # A drifted sequence keeps its positive-advantage tokens (per-token advantages of a multi-turn episode).
    keep = sequence_mask_keep(torch.full((1, 3), -1.0), torch.tensor([[1.0, -1.0, 0.5]]), torch.ones(1, 3), 0.5)
    assert keep.tolist() == [[True, False, True]]


def test_pass_rate_filter_hand_computed():
    """Pass rates at pass_reward 1: [1, 0.75, 0, 0.75]."""
    rewards = torch.tensor([[1.0, 1, 1, 1], [1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0.5]])
    assert prompts_to_retire(rewards, threshold=0.9).tolist() == [True, False, False, False]
    assert prompts_to_retire(rewards, threshold=0.75).tolist() == [True, True, False, True]
    assert prompts_to_retire(rewards, threshold=0.9, drop_zero_variance=True).tolist() == [True, False, True, False]
    assert prompts_to_retire(rewards, threshold=0.9, pass_reward=0.5).tolist() == [True, False, False, True]
