"""cispo_loss against hand-computed numbers, its gradient, and its invariants.

The small case used throughout (float64, ratio_max 5):

    logp      = [[-1.0, -2.0, -0.5], [-0.25, -1.5, -3.0]]
    ratio     = [[ 8,    1,    10 ], [ 1/8,   2,    1  ]]   (old = logp - log ratio)
    mask      = [[ 1,    1,    0  ], [ 1,     1,    1  ]]
    A         = [1, -2]
    w         = min(ratio, 5) = [[5, 1, -], [1/8, 2, 1]]    (no lower bound, not even 1/ratio_max)
    -w*A*logp = [[5, 2, -], [-0.0625, -6, -6]]             sum -5.0625 over 5 tokens
"""

from __future__ import annotations

import math

import pytest
import torch

from worker.cispo.loss import LossInputs, cispo_loss

F64 = torch.float64
E = math.e
LN2 = math.log(2.0)


def _t(rows):
    return torch.tensor(rows, dtype=F64)


LOGP = [[-1.0, -2.0, -0.5], [-0.25, -1.5, -3.0]]
REF_MINUS_LOGP = [[0.0, LN2, 5.0], [-LN2, 0.0, 1.0]]  # k3 = [0, 1-ln2, (masked), ln2-0.5, 0, e-2]


def _small_case(with_ref=False):
    logp = _t(LOGP).requires_grad_()
    ratio = _t([[8.0, 1.0, 10.0], [0.125, 2.0, 1.0]])
    old = _t(LOGP) - ratio.log()
    ref = _t(LOGP) + _t(REF_MINUS_LOGP) if with_ref else None
    inputs = LossInputs(
        logprobs_BT=logp,
        old_logprobs_BT=old,
        advantages_B=_t([1.0, -2.0]),
        action_mask_BT=torch.tensor([[1, 1, 0], [1, 1, 1]]),
        ref_logprobs_BT=ref,
    )
    return logp, inputs


def _close(actual, expected, atol=1e-12):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), rtol=0, atol=atol)


def test_loss_value_and_sums_hand_computed():
    """Token-normalised loss -5.0625/5, one clipped token (the masked ratio 10 is not counted), ratio_N in order."""
    _, inputs = _small_case()
    out = cispo_loss(inputs, normalizer=5, ratio_max=5.0)
    _close(out.loss, -1.0125)
    assert out.sums["tokens"].item() == 5.0
    assert out.sums["clipped"].item() == 1.0
    _close(out.sums["pg_loss"], -5.0625)
    # k3 of the rollout policy vs current: 1/r + ln r - 1 per token, i.e.
    # (1/8 + 3 ln2 - 1) + 0 + (8 - 3 ln2 - 1) + (1/2 + ln2 - 1) + 0 = 5.625 + ln2.
    _close(out.sums["kl_old"], 5.625 + LN2)
    assert "kl_ref" not in out.sums
    _close(out.ratio_N, [8.0, 1.0, 0.125, 2.0, 1.0])
    assert not out.ratio_N.requires_grad


def test_normalizer_divides_the_sum():
    """The loss is the masked sum divided by the caller's normalizer, not by this batch's token count."""
    _, inputs = _small_case()
    _close(cispo_loss(inputs, normalizer=21, ratio_max=5.0).loss, -5.0625 / 21)


def test_ratio_max_changes_the_cap():
    """With ratio_max 10 the ratio-8 token is no longer clipped: its term becomes 8 instead of 5."""
    _, inputs = _small_case()
    out = cispo_loss(inputs, normalizer=5, ratio_max=10.0)
    _close(out.loss, (8 + 2 - 0.0625 - 6 - 6) / 5)
    assert out.sums["clipped"].item() == 0.0


def test_gradient_treats_weight_as_constant():
    """d loss / d logp = -w * A / N for action tokens (w = 5 above the cap, w = 1/8 below 1), 0 when masked."""
    logp, inputs = _small_case()
    (grad,) = torch.autograd.grad(cispo_loss(inputs, normalizer=5, ratio_max=5.0).loss, logp)
    _close(grad, [[-1.0, -0.2, 0.0], [0.05, 0.8, 0.4]])
    assert grad[0, 2].item() == 0.0


def test_per_sequence_normalisation_hand_computed():
    """per_sequence: (7/2 + (-12.0625)/3) / 2 sequences = -25/96."""
    _, inputs = _small_case()
    out = cispo_loss(inputs, normalizer=2, ratio_max=5.0, per_sequence=True)
    _close(out.loss, -25.0 / 96.0)


def test_per_sequence_gradient_hand_computed():
    """per_sequence gradient: -w * A / (tokens_i * n_sequences)."""
    logp, inputs = _small_case()
    out = cispo_loss(inputs, normalizer=2, ratio_max=5.0, per_sequence=True)
    (grad,) = torch.autograd.grad(out.loss, logp)
    _close(grad, [[-5 / 4, -1 / 4, 0.0], [0.125 * 2 / 6, 2 * 2 / 6, 1 * 2 / 6]])


def test_per_sequence_fully_masked_row_contributes_zero():
    """A sequence with no action tokens adds exactly 0 (no division by zero)."""
    logp = _t([[-1.0, -2.0], [-0.5, -0.7]])
    inputs = LossInputs(
        logprobs_BT=logp,
        old_logprobs_BT=logp.clone(),
        advantages_B=_t([3.0, 1.0]),
        action_mask_BT=torch.tensor([[0, 0], [1, 1]]),
    )
    out = cispo_loss(inputs, normalizer=1, per_sequence=True)
    _close(out.loss, -(-0.5 - 0.7) / 2)


def test_kl_penalty_adds_beta_times_mean_k3():
    """ref - logp = [[0, ln2, 5(masked)], [-ln2, 0, 1]]: k3 = [0, 1-ln2, ln2-0.5, 0, e-2], sum e-1.5."""
    _, inputs = _small_case(with_ref=True)
    out = cispo_loss(inputs, normalizer=5, ratio_max=5.0, kl_beta=0.1)
    _close(out.loss, -1.0125 + 0.1 * (E - 1.5) / 5)
    _close(out.sums["kl_ref"], E - 1.5)


def test_kl_clamp_binds_per_token():
    """kl_clamp 0.5 caps the e-2 token: sum k3 = (1-ln2) + (ln2-0.5) + 0.5 = 1; its KL gradient vanishes."""
    logp, inputs = _small_case(with_ref=True)
    out = cispo_loss(inputs, normalizer=5, ratio_max=5.0, kl_beta=0.1, kl_clamp=0.5)
    _close(out.loss, -1.0125 + 0.1 * 1.0 / 5)
    # The metric is the unclamped estimate (as kl_old is); the clamp shows as one bound token.
    _close(out.sums["kl_ref"], E - 1.5)
    _close(out.sums["kl_ref_clamped"], 1.0)
    # d k3 / d logp = 1 - e^d: 0 at d=0, -1 at d=ln2, 0.5 at d=-ln2; the clamped d=1 token gets none.
    (grad,) = torch.autograd.grad(out.loss, logp)
    kl_grad = _t([[0.0, -1.0, 0.0], [0.5, 0.0, 0.0]]) * 0.1 / 5
    _close(grad, _t([[-1.0, -0.2, 0.0], [0.05, 0.8, 0.4]]) + kl_grad)


def test_kl_ref_equals_kl_old_when_the_reference_is_the_rollout_policy():
    """Same estimator, tokens and sums: with ref == old they agree exactly, even where the penalty's clamp binds."""
    logp = _t([[-0.1, -3.0, -0.2], [-4.0, -1.0, -0.5]])
    old = _t([[-2.0, -0.1, -0.2], [-0.3, -1.0, -6.0]])
    inputs = LossInputs(logprobs_BT=logp, old_logprobs_BT=old, advantages_B=_t([1.0, -1.0]),
                        action_mask_BT=torch.tensor([[1, 1, 0], [1, 1, 1]]), ref_logprobs_BT=old.clone())
    out = cispo_loss(inputs, normalizer=5, kl_beta=0.1, kl_clamp=2.0)
    assert out.sums["kl_ref_clamped"] > 0  # the clamp binds on some tokens
    assert out.sums["kl_ref"] == out.sums["kl_old"]


def test_ref_without_beta_only_reports_kl():
    """With ref_logprobs but kl_beta 0 the loss is unchanged and kl_ref is still reported."""
    _, inputs = _small_case(with_ref=True)
    out = cispo_loss(inputs, normalizer=5, ratio_max=5.0)
    _close(out.loss, -1.0125)
    _close(out.sums["kl_ref"], E - 1.5)


def test_kl_beta_without_ref_raises():
    """kl_beta > 0 needs reference log-probs."""
    _, inputs = _small_case()
    with pytest.raises(ValueError, match="ref"):
        cispo_loss(inputs, normalizer=5, kl_beta=0.1)


@pytest.mark.parametrize("ratio_max", [0.5, 0.999])
def test_ratio_max_below_one_raises(ratio_max):
    """The cap must be at least 1."""
    _, inputs = _small_case()
    with pytest.raises(ValueError, match="ratio_max"):
        cispo_loss(inputs, normalizer=5, ratio_max=ratio_max)


@pytest.mark.parametrize("normalizer", [0, -1.0])
def test_non_positive_normalizer_raises(normalizer):
    """The normalizer must be positive."""
    _, inputs = _small_case()
    with pytest.raises(ValueError, match="normalizer"):
        cispo_loss(inputs, normalizer=normalizer)


def _random_batch(seed, B=6, T=5, with_ref=True):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=F64) * 3
    old = logp + torch.randn(B, T, generator=g, dtype=F64)  # ratios spread well above 5 and below 1
    lengths = torch.tensor([5, 1, 3, 0, 4, 2])[:B]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    ref = logp + 0.5 * torch.randn(B, T, generator=g, dtype=F64) if with_ref else None
    adv = torch.randn(B, generator=g, dtype=F64)
    return logp, old, adv, mask, ref


@pytest.mark.parametrize("per_sequence", [False, True])
def test_micro_batches_sum_to_whole_batch(per_sequence):
    """Summing micro-batch losses (normalizer = whole-batch count) equals the whole-batch loss and gradient."""
    logp0, old, adv, mask, ref = _random_batch(0)
    normalizer = float(mask.shape[0]) if per_sequence else float(mask.sum())
    kwargs = dict(normalizer=normalizer, ratio_max=2.0, kl_beta=0.05, kl_clamp=0.3, per_sequence=per_sequence)

    logp = logp0.clone().requires_grad_()
    whole = cispo_loss(LossInputs(logp, old, adv, mask, ref), **kwargs)
    assert 0 < whole.sums["clipped"].item() < whole.sums["tokens"].item()  # the cap binds somewhere
    (grad_whole,) = torch.autograd.grad(whole.loss, logp)

    logp = logp0.clone().requires_grad_()
    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
    outs = [cispo_loss(LossInputs(logp[s], old[s], adv[s], mask[s], ref[s]), **kwargs) for s in parts]
    (grad_parts,) = torch.autograd.grad(sum(o.loss for o in outs), logp)

    _close(sum(o.loss for o in outs), whole.loss.detach())
    _close(grad_parts, grad_whole)
    for key in ("tokens", "clipped", "pg_loss", "kl_old", "kl_ref"):
        _close(sum(o.sums[key] for o in outs), whole.sums[key])
    _close(torch.cat([o.ratio_N for o in outs]), whole.ratio_N)


def test_on_policy_is_reinforce():
    """When old == current logprobs every ratio is exactly 1 and the loss is -mean(A * logp) over action tokens."""
    logp0, _, adv, mask, _ = _random_batch(1, with_ref=False)
    logp = logp0.clone().requires_grad_()
    out = cispo_loss(LossInputs(logp, logp0.clone(), adv, mask), normalizer=float(mask.sum()), ratio_max=1.0)
    assert torch.equal(out.ratio_N, torch.ones(int(mask.sum()), dtype=F64))
    assert out.sums["clipped"].item() == 0.0
    m = mask.bool()
    expected = -(adv[:, None] * logp0)[m].mean()
    _close(out.loss, expected)
    (grad,) = torch.autograd.grad(out.loss, logp)
    _close(grad, -(adv[:, None] * mask) / mask.sum())


# -- truncated importance sampling against the sampler's log-probs ---------------
#
# s = exp(old - sampler) = [[1, 4, 9(masked)], [1/2, 1, 3]]; tis_cap 2: tis = [[1, 2, -], [1/2, 1, 2]]
# -w*A*logp*tis = [[5, 4, -], [-0.03125, -6, -12]]          sum -9.03125 over 5 tokens
# |old - sampler| = ln s: 0 + 2 ln2 + ln2 + 0 + ln3;  k3(sampler, old) = s - ln s - 1: 0 + (3 - 2 ln2)
# + (ln2 - 1/2) + 0 + (2 - ln3) = 4.5 - ln2 - ln3

SAMPLER_RATIO = [[1.0, 4.0, 9.0], [0.5, 1.0, 3.0]]


def _with_sampler(inputs: LossInputs) -> LossInputs:
    sampler = inputs.old_logprobs_BT - _t(SAMPLER_RATIO).log()
    return LossInputs(inputs.logprobs_BT, inputs.old_logprobs_BT, inputs.advantages_B, inputs.action_mask_BT,
                      inputs.ref_logprobs_BT, sampler_logprobs_BT=sampler)


def test_tis_weight_hand_computed():
    """The policy-gradient terms are multiplied by min(exp(old - sampler), cap); the masked token is not counted."""
    _, inputs = _small_case()
    out = cispo_loss(_with_sampler(inputs), normalizer=5, ratio_max=5.0, tis_cap=2.0)
    _close(out.loss, -9.03125 / 5)
    _close(out.sums["pg_loss"], -9.03125)
    _close(out.sums["tis_weight"], 6.5)
    assert out.sums["tis_capped"].item() == 2.0
    _close(out.sums["sampler_abs_diff"], 3 * LN2 + math.log(3.0))
    _close(out.sums["sampler_kl"], 4.5 - LN2 - math.log(3.0))
    _close(out.ratio_N, [8.0, 1.0, 0.125, 2.0, 1.0])  # the CISPO ratio itself is unchanged


def test_tis_gradient_treats_weight_as_constant():
    """d loss / d logp = -w * tis * A / N: the sampler weight carries no gradient."""
    logp, inputs = _small_case()
    (grad,) = torch.autograd.grad(cispo_loss(_with_sampler(inputs), normalizer=5, tis_cap=2.0).loss, logp)
    _close(grad, [[-1.0, -0.4, 0.0], [0.025, 0.8, 0.8]])


def test_tis_does_not_weight_the_kl_penalty():
    """With a reference, only the policy-gradient part is corrected: the KL term is as without TIS."""
    _, inputs = _small_case(with_ref=True)
    out = cispo_loss(_with_sampler(inputs), normalizer=5, ratio_max=5.0, kl_beta=0.1, tis_cap=2.0)
    _close(out.loss, -9.03125 / 5 + 0.1 * (E - 1.5) / 5)


@pytest.mark.parametrize("cap", [None, 0.0])
def test_tis_disabled_leaves_loss_but_reports_mismatch(cap):
    """tis_cap None/0: the loss is plain CISPO, and the sampler mismatch is still measured."""
    _, inputs = _small_case()
    out = cispo_loss(_with_sampler(inputs), normalizer=5, ratio_max=5.0, tis_cap=cap)
    _close(out.loss, -1.0125)
    assert "tis_weight" not in out.sums and "tis_capped" not in out.sums
    _close(out.sums["sampler_abs_diff"], 3 * LN2 + math.log(3.0))
    _close(out.sums["sampler_kl"], 4.5 - LN2 - math.log(3.0))


def test_tis_without_sampler_logprobs_changes_nothing():
    """An engine that reports no log-probs (transformers) gets plain CISPO and no mismatch metrics."""
    _, inputs = _small_case()
    out = cispo_loss(inputs, normalizer=5, ratio_max=5.0, tis_cap=2.0)
    _close(out.loss, -1.0125)
    assert not {"tis_weight", "tis_capped", "sampler_abs_diff", "sampler_kl"} & out.sums.keys()


def test_tis_cap_below_one_raises():
    """A cap below 1 would shrink every on-policy token; refuse it."""
    _, inputs = _small_case()
    with pytest.raises(ValueError, match="tis_cap"):
        cispo_loss(_with_sampler(inputs), normalizer=5, tis_cap=0.5)


def test_tis_micro_batches_sum_to_whole_batch():
    """With TIS on, micro-batch losses, gradients and sums still add up to the whole batch's."""
    logp0, old, adv, mask, ref = _random_batch(2)
    sampler = old + 0.7 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    kwargs = dict(normalizer=float(mask.sum()), ratio_max=2.0, kl_beta=0.05, tis_cap=1.5)
    logp = logp0.clone().requires_grad_()
    whole = cispo_loss(LossInputs(logp, old, adv, mask, ref, sampler), **kwargs)
    assert 0 < whole.sums["tis_capped"].item() < whole.sums["tokens"].item()  # the cap binds somewhere
    (grad_whole,) = torch.autograd.grad(whole.loss, logp)
    logp = logp0.clone().requires_grad_()
    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
    outs = [cispo_loss(LossInputs(logp[s], old[s], adv[s], mask[s], ref[s], sampler[s]), **kwargs) for s in parts]
    (grad_parts,) = torch.autograd.grad(sum(o.loss for o in outs), logp)
    _close(sum(o.loss for o in outs), whole.loss.detach())
    _close(grad_parts, grad_whole)
    for key in ("tis_weight", "tis_capped", "sampler_abs_diff", "sampler_kl"):
        _close(sum(o.sums[key] for o in outs), whole.sums[key])


# -- edges found by mutation testing (bench/mutate.py) ---------------------------------------------------


def _one_row(logp, old, adv=1.0, mask=None, **sampler):
    logp_t = torch.tensor([logp], dtype=torch.float32)
    return LossInputs(logprobs_BT=logp_t, old_logprobs_BT=torch.tensor([old], dtype=torch.float32),
                      advantages_B=torch.tensor([adv], dtype=torch.float32),
                      action_mask_BT=torch.ones_like(logp_t) if mask is None else torch.tensor([mask]), **sampler)


def test_log_ratios_are_clamped_to_plus_minus_20_in_the_reported_ratios():
    out = cispo_loss(_one_row([0.0, 0.0, 0.0], [-30.0, 30.0, -20.0]), normalizer=1.0)
    expected = torch.tensor([math.exp(20.0), math.exp(-20.0), math.exp(20.0)], dtype=torch.float32)
    torch.testing.assert_close(out.ratio_N, expected, rtol=1e-6, atol=0.0)


def test_the_tis_weight_floor_is_exp_minus_20():
    sampler = torch.tensor([[30.0]])  # old - sampler = -30: the weight is exp(-20), not exp(-30)
    out = cispo_loss(_one_row([0.0], [0.0], sampler_logprobs_BT=sampler), normalizer=1.0, tis_cap=2.0)
    torch.testing.assert_close(out.sums["tis_weight"], torch.tensor(math.exp(-20.0)), rtol=1e-6, atol=0.0)


def test_tis_cap_of_exactly_one_is_allowed_and_a_weight_at_the_cap_is_not_counted_as_capped():
    same = torch.tensor([[-1.0, -2.0]])
    out = cispo_loss(_one_row([-1.0, -2.0], [-1.0, -2.0], sampler_logprobs_BT=same), normalizer=1.0, tis_cap=1.0)
    assert out.sums["tis_capped"].item() == 0.0 and out.sums["tis_weight"].item() == 2.0


def test_default_kl_clamp_is_10_per_token():
    inputs = _one_row([0.0], [0.0], mask=[1.0])
    inputs = LossInputs(**{**inputs.__dict__, "ref_logprobs_BT": torch.tensor([[20.0]])})  # k3 ~ e^20
    out = cispo_loss(inputs, normalizer=1.0, kl_beta=1.0)
    assert out.loss.item() == 10.0  # logp 0: the policy term is 0, the penalty is the clamped k3
    assert out.sums["kl_ref_clamped"].item() == 1.0 and out.sums["kl_ref"].item() > 1e8  # the metric is unclamped


def test_sums_are_floats_of_the_policys_dtype_whatever_the_mask_and_advantages_dtypes():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inputs = LossInputs(logprobs_BT=logp, old_logprobs_BT=torch.tensor([[-5.0, -2.0]]),
                        advantages_B=torch.tensor([1.0], dtype=torch.float64),
                        action_mask_BT=torch.tensor([[True, True]]),
                        sampler_logprobs_BT=torch.tensor([[-9.0, -2.0]]))
    out = cispo_loss(inputs, normalizer=1.0, tis_cap=2.0)
    assert out.loss.dtype == torch.float32
    for name in ("tokens", "clipped", "tis_capped", "pg_loss"):
        assert out.sums[name].dtype == torch.float32, name
    assert (out.sums["tokens"].item(), out.sums["clipped"].item(), out.sums["tis_capped"].item()) == (2.0, 1.0, 1.0)


def test_per_token_advantages_weight_each_token():
    logp = _t([[-1.0, -2.0], [-0.5, -1.0]])
    inputs = LossInputs(logprobs_BT=logp, old_logprobs_BT=logp.clone(), advantages_B=_t([[1.0, 2.0], [-1.0, 3.0]]),
                        action_mask_BT=torch.ones_like(logp))
    # ratio 1 everywhere: loss = -sum(A * logp) = -(-1 - 4 + 0.5 - 3)
    _close(cispo_loss(inputs, normalizer=1.0).loss, 7.5)


def test_per_sequence_mean_of_a_one_token_sequence_divides_by_one():
    logp = _t([[-2.0, -1.0]])
    inputs = LossInputs(logprobs_BT=logp, old_logprobs_BT=logp.clone(), advantages_B=_t([1.0]),
                        action_mask_BT=_t([[1.0, 0.0]]))
    _close(cispo_loss(inputs, normalizer=1.0, per_sequence=True).loss, 2.0)


def test_kl_beta_without_ref_names_the_missing_input():
    with pytest.raises(ValueError, match="^kl_beta > 0 needs ref_logprobs_BT$"):
        cispo_loss(_one_row([0.0], [0.0]), normalizer=1.0, kl_beta=0.1)
