"""Did the policy move too far in one step? A warning naming the likely cause, before the run diverges.

`kl_old` is the token mean of the k3 estimate between the policy that sampled a step's completions and the
policy during that step's mini-batch updates (docs/TRAINING.md, Metrics per step). It grows only when one
rollout batch feeds several optimizer steps, and a healthy run keeps it near 0-2. Tens of nats per token mean
that a few optimizer steps turned the policy into another one. The CISPO weight caps the importance ratio
only from above (`loss.ratio_max`), so a policy that moves away from the sampled tokens (ratios far below 1)
is never clipped: the clip fraction stays 0 while the run drifts. The usual cause is a learning rate too high
for the model; several mini-batches or update epochs per rollout multiply its effect.
"""

from __future__ import annotations

KL_OLD_WARN = 5.0  # nats per token within one step; the toy task's high learning rate moves it 1-2
BARELY_CLIPPED = 0.01


def policy_jump_message(metrics: dict[str, float], *, lr: float, ratio_max: float, mini_batches: int,
                        update_epochs: int) -> str | None:
    """The warning for a step whose kl_old passed KL_OLD_WARN, or None."""
    kl = metrics.get("kl_old")
    if kl is None or not kl > KL_OLD_WARN:
        return None
    clip = metrics.get("clip_fraction", 0.0)
    text = (f"kl_old {kl:.4g}: the policy moved far from the one that sampled this step's completions within "
            f"one step (above {KL_OLD_WARN:g} nats per token; a steady run stays near 0-2)")
    if clip < BARELY_CLIPPED:
        text += (f", and the clip fraction is {clip:.2g}: loss.ratio_max ({ratio_max:g}) caps the importance "
                 "ratio only from above, so it never bounded this move")
    updates = mini_batches * update_epochs
    text += (f". Likely cause: optimizer.lr {lr:g} is too high for this model; lower it (e.g. by 10x)"
             + (f", or take fewer optimizer steps per rollout ({mini_batches} mini_batches x {update_epochs} "
                "update_epochs)" if updates > 1 else ""))
    return text


class PolicyJumpWatch:
    """Says once per spike: on the step kl_old first passes the threshold, again only after it fell back."""

    def __init__(self, **limits):
        self.limits, self.above = limits, False

    def update(self, metrics: dict[str, float]) -> str | None:
        message = policy_jump_message(metrics, **self.limits)
        fresh = message is not None and not self.above
        self.above = message is not None
        return message if fresh else None
