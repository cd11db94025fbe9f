"""group_advantages against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from worker.cispo.advantages import group_advantages


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_mean_only_default_hand_computed():
    """Default scale subtracts the group mean only; all-equal groups are flagged."""
    adv, zero = group_advantages(_t([[1, 0, 0, 1], [2, 2, 2, 2]]))
    assert adv.dtype == torch.float32
    assert adv.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    assert zero.tolist() == [False, True]


def test_mean_only_uneven_group_hand_computed():
    """Mean 2.75 of [0, 1, 0, 10] -> [-2.75, -1.75, -2.75, 7.25] (no scaling by default)."""
    adv, zero = group_advantages(_t([[0, 1, 0, 10]]))
    assert adv.tolist() == [[-2.75, -1.75, -2.75, 7.25]]
    assert zero.tolist() == [False]


def test_group_std_uses_population_std_plus_eps():
    """group_std divides by the population std (unbiased=False) + eps, hand-computed.

    Row [1,0,0,1]: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 0.5) = +-0.5
    (the unbiased std sqrt(1/3) would give +-0.464).
    Row [0,4,4,0]: mean 2, population std 2 -> +-2 / (2 + 0.5) = +-0.8.
    """
    adv, zero = group_advantages(_t([[1, 0, 0, 1], [0, 4, 4, 0]]), scale="group_std", eps=0.5)
    torch.testing.assert_close(
        adv, _t([[0.5, -0.5, -0.5, 0.5], [-0.8, 0.8, 0.8, -0.8]]), rtol=0, atol=1e-7
    )
    assert zero.tolist() == [False, False]


@pytest.mark.parametrize("rewards,eps,expected", [
    # [0, 3]: mean 1.5, std 1.5 -> +-1.5/2; [2, 2.5]: mean 2.25, std 0.25 -> +-0.25/0.75
    ([[0, 3], [2, 2.5]], 0.5, [[-0.75, 0.75], [-1 / 3, 1 / 3]]),
    # a group of 8 with std 2 (mean 5) beside one with std 1 (mean 2), eps 1: (r - 5) / 3 and (r - 2) / 2
    ([[2, 4, 4, 4, 5, 5, 7, 9], [1, 1, 1, 1, 3, 3, 3, 3]], 1.0,
     [[-1, -1 / 3, -1 / 3, -1 / 3, 0, 0, 2 / 3, 4 / 3], [-0.5] * 4 + [0.5] * 4]),
    # three completions, negative rewards: [-3, 0, 3] mean 0, std sqrt(6); [-1, -1, 2] mean 0, std sqrt(2)
    ([[-3, 0, 3], [-1, -1, 2]], 0.0,
     [[-3 / math.sqrt(6), 0, 3 / math.sqrt(6)], [-1 / math.sqrt(2), -1 / math.sqrt(2), 2 / math.sqrt(2)]]),
])
def test_group_std_scales_each_group_by_its_own_population_std(rewards, eps, expected):
    """Each case alone tells group_std from its likely breakages: the unbiased std, a variance for the std, eps
    dropped or multiplied, one std for the whole batch, or no division at all (groups of different spreads, sizes
    and signs, hand-computed)."""
    adv, zero = group_advantages(torch.tensor(rewards, dtype=torch.float64), scale="group_std", eps=eps)
    torch.testing.assert_close(adv, _t(expected), rtol=0, atol=1e-6)
    assert not zero.any()


def test_group_std_small_eps_unit_variance():
    """With the default tiny eps, [1, 3] (mean 2, population std 1) gives -+1/(1+1e-6)."""
    adv, _ = group_advantages(_t([[1, 3]]), scale="group_std")
    expected = 1.0 / (1.0 + 1e-6)
    torch.testing.assert_close(adv, _t([[-expected, expected]]), rtol=0, atol=1e-7)
    # Bessel's correction would give std sqrt(2) and +-0.7071: make sure that is not what we got.
    assert abs(adv[0, 1].item() - 1 / math.sqrt(2)) > 0.2


def test_clip_mean_only():
    """clip bounds advantages to [-clip, clip] and leaves smaller ones untouched."""
    adv, _ = group_advantages(_t([[0, 1, 0, 10]]), clip=2.0)
    assert adv.tolist() == [[-2.0, -1.75, -2.0, 2.0]]


def test_clip_applies_after_group_std_scaling():
    """[0, 10] scaled by its std 5 is ~+-1; clip 0.5 then gives exactly +-0.5."""
    adv, _ = group_advantages(_t([[0, 10]]), scale="group_std", clip=0.5)
    assert adv.tolist() == [[-0.5, 0.5]]


@pytest.mark.parametrize("scale", ["none", "group_std"])
def test_all_equal_group_is_exactly_zero(scale):
    """Groups with equal rewards give exact zeros, even where float rounding of the mean would not.

    In float64, mean([0.1] * 3) = 0.10000000000000002 and mean([0.7] * 3) is off by 1e-16 too,
    so r - mean is not 0 (and is huge once divided by std + a tiny eps) unless forced to 0.
    """
    rewards = torch.tensor(
        [[0.1, 0.1, 0.1], [0.7, 0.7, 0.7], [-7.0, -7.0, -7.0], [0.0, 1.0, 2.0]], dtype=torch.float64
    )
    adv, zero = group_advantages(rewards, scale=scale, eps=1e-12)
    assert zero.tolist() == [True, True, True, False]
    assert torch.equal(adv[:3], torch.zeros(3, 3))
    assert (adv[3] != 0).tolist() == [True, False, True]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_raise(bad):
    """NaN or infinite rewards are refused."""
    with pytest.raises(ValueError, match="^rewards must be finite$"):
        group_advantages(_t([[1.0, 0.0], [0.0, bad]]))


@pytest.mark.parametrize("shape", [(4,), (2, 1), (3, 0), (2, 2, 2)])
def test_wrong_shapes_raise(shape):
    """Rewards must be 2-D (prompts, group) with a group of at least 2."""
    with pytest.raises(ValueError, match="rewards must be"):
        group_advantages(torch.zeros(shape))


def test_unknown_scale_raises():
    """An unknown scale name is refused rather than silently ignored."""
    with pytest.raises(ValueError, match="scale"):
        group_advantages(_t([[0, 1]]), scale="batch_mean")
