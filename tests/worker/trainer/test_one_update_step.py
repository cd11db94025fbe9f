"""The update paths share one optimizer step: the trainer alone (worker/trainer/update.py) and the resident jobs'
batched update (worker/multi/update.py) run one plan (worker/trainer/plan.py), and with supervised fine-tuning
build the micro-batch loss, clip and step through worker/trainer/step.py, so a knob read in one place reaches
every path. Read with ast: a copy of the
loss call or of the clipping elsewhere in worker/ is how the paths drifted apart. That the two CISPO paths
give the same numbers is tests/worker/multi/test_batched_update.py's each-adapter-equals-alone test."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from worker.trainer.step import optimizer_step

REPO = Path(__file__).resolve().parents[3]


def _called(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def test_the_loss_call_and_the_clipping_have_one_home():
    homes = {name: sorted(str(p.relative_to(REPO)) for p in (REPO / "worker").rglob("*.py")
                          if "cispo" not in p.relative_to(REPO).parts and name in _called(p))
             for name in ("cispo_loss", "clip_grad_norm_")}
    # the engine's "cispo" loss is the same function under Tinker's sum convention (normalizer 1), not a copy
    assert homes == {"cispo_loss": ["worker/engine/losses.py", "worker/trainer/step.py"],
                     "clip_grad_norm_": ["worker/trainer/step.py"]}


def test_both_cispo_updates_run_one_plan():
    """The kept sequences, advantages, logp_old's source, mini-batches, normalisers and prompt weights are
    worker/trainer/plan.py's; each update path only runs its own forwards of that plan."""
    plan = _called(REPO / "worker/trainer/plan.py")
    assert {"micro_batch_loss", "optimizer_step", "shuffled_mini_batches", "sequence_weights"} <= plan
    for module in ("worker/trainer/update.py", "worker/multi/update.py"):
        called = _called(REPO / module)
        assert "plan_update" in called, module
        assert not called & {"micro_batch_loss", "optimizer_step", "shuffled_mini_batches", "sequence_weights"}, module
    assert "optimizer_step" in _called(REPO / "worker/trainer/supervised.py")


@pytest.mark.parametrize("max_norm, moved", [(1.0, [0.6, 0.8]), (None, [3.0, 4.0])])
def test_optimizer_step_clips_then_steps_and_reports_the_norm_before_clipping(max_norm, moved):
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])  # norm 5
    assert optimizer_step([p], torch.optim.SGD([p], lr=1.0), max_norm) == pytest.approx(5.0)
    assert p.detach().tolist() == pytest.approx([-m for m in moved])
