"""Every swap of a module's forward or weights the worker makes falls back to the plain path when it fails: the job
trains on, with the plain path's losses, and one warn event names the optimisation (worker/model/optional_swaps.py)."""

from __future__ import annotations

import pytest

from tests.specs import small_spec
from tests.worker.trainer.test_trainer import StopAt
from worker.model import lean_backward, lora_forward, optional_swaps
from worker.rollout import effective_weights, packed_linears, rollout, static_decode
from worker.trainer.loop import train


def _raising(*_args, **_kwargs):
    raise RuntimeError("an optimisation this model does not support")


def _failing_factory(*_args, **_kwargs):
    return _raising


def _compiled(monkeypatch) -> None:
    real = rollout.sample_tokens
    monkeypatch.setattr(rollout, "sample_tokens", lambda *a, **k: real(*a, **{**k, "compiled": True}))


def _packed_toy_linears(monkeypatch) -> None:
    monkeypatch.setattr(packed_linears, "FLOAT32_PACK_MIN_ELEMENTS", 0)  # the toy model's linears pack too,
    monkeypatch.setattr(rollout, "PACK_MIN_NEW_TOKENS", 0)  # in its short rollouts


# optimisation -> (what its plain run needs as well, how the forced run makes it fail)
FAILURES = {
    "lean backward": (None, lambda mp: (mp.setattr(lean_backward, "_norm_forward", _failing_factory),
                                        mp.setattr(lean_backward, "_mlp_forward", _failing_factory))),
    "fused LoRA forward": (None, lambda mp: mp.setattr(lora_forward, "_fused_forward", _failing_factory)),
    "effective weights": (None, lambda mp: mp.setattr(effective_weights, "_quantized_base", _raising)),
    "lean LoRA rollout forward": (None, lambda mp: mp.setattr(effective_weights, "_lean_lora_forward",
                                                              _failing_factory)),
    "packed linears": (_packed_toy_linears, lambda mp: (_packed_toy_linears(mp),
                                                        mp.setattr(effective_weights, "packed_forward",
                                                                   _failing_factory))),
    "compiled decoding": (None, lambda mp: (_compiled(mp), mp.setattr(static_decode, "compiled_step",
                                                                      _failing_factory))),
}


# Forced together, a group's failures hide none of each other's: effective weights failing on entry would leave the
# lean LoRA forward and packed linears nothing to swap, so those two fail in a job of their own.
GROUPS = [("effective weights", "lean backward", "fused LoRA forward", "compiled decoding"),
          ("lean LoRA rollout forward", "packed linears")]


class Collect(StopAt):
    def __init__(self):
        super().__init__(99)
        self.losses, self.warnings = [], []

    def on_step(self, step, metrics):
        super().on_step(step, metrics)
        self.losses.append(metrics["loss"])

    def on_warning(self, step, message):
        self.warnings.append(message)


def _train(toy_dir, tmp_path) -> Collect:
    collect = Collect()
    spec = small_spec(toy_dir, steps=2, batch_size=2, group_size=2, mini_batches=1, eval_max_rows=2,
                      preflight_groups=0, checkpoint_interval=0)
    train(spec, tmp_path, callbacks=collect)
    return collect


def test_every_optimisation_is_named_and_forced_once():
    assert set(FAILURES) == set(optional_swaps.OPTIMISATIONS)
    assert sorted(name for group in GROUPS for name in group) == sorted(FAILURES)


@pytest.mark.slow
@pytest.mark.parametrize("names", GROUPS, ids=lambda names: ", ".join(names))
def test_failing_optimisations_fall_back_with_the_plain_paths_losses_and_say_so_once(names, toy_dir, tmp_path,
                                                                                     monkeypatch):
    with monkeypatch.context() as mp:
        for name in names:
            if (setup := FAILURES[name][0]) is not None:
                setup(mp)
        with optional_swaps.switched_off(*names):
            plain = _train(toy_dir, tmp_path / "plain")
    assert plain.warnings == []
    for name in names:
        FAILURES[name][1](monkeypatch)
    failed = _train(toy_dir, tmp_path / "failed")
    assert len(failed.losses) == 2 and failed.losses == plain.losses
    named = sorted(next(n for n in names if message.startswith(n)) for message in failed.warnings)
    assert named == sorted(names), failed.warnings  # one warn event each
    assert all("an optimisation this model does not support" in message for message in failed.warnings)
