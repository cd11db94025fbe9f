"""worker/model/optional_swaps.py: what counts as an optimisation failing, and what does not."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from worker.model import optional_swaps
from worker.model.optional_swaps import guarded


def test_a_checkpoints_early_stop_inside_a_guarded_forward_is_no_failure():
    """Non-reentrant checkpointing stops its recomputation by raising through the forwards it reruns (as
    transformers' gradient checkpointing does on every layer): a guarded forward lets that through, stays on, and
    the gradients are the plain ones. Taking the stop for a failure switched the optimisation off and ran the plain
    forward past the stop, which failed backward ("target_frame.early_stop is set")."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    x = torch.randn(3, 4)
    optional_swaps.take_messages()

    def plain(h):
        return model[1](torch.tanh(model[0](h)))

    forward = guarded(model, "lean backward", lambda h: plain(h) * 1.0, plain)
    checkpoint(forward, x, use_reentrant=False).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain(x).sum().backward()

    assert optional_swaps.enabled(model, "lean backward")
    assert optional_swaps.take_messages() == []
    for got, want in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want)
