"""The Tinker worker (worker/tinker/runner.py) behind the real API, driven by the real SDK: what a training client
computes over HTTP is what the engine computes in process, a saved state resumes exactly, and another project's
path is not found."""

from __future__ import annotations

import pytest
import torch

from worker.engine import AdamParams as EngineAdam
from worker.engine import AdapterConfig, Datum, Pass
from worker.engine.engine import Engine

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

TOL = 1e-5
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 1.0}


def _batch(seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (6, 4):
        tokens = torch.randint(4, 40, (n + 1,), generator=g).tolist()
        out.append((tokens[:-1], tokens[1:], [0.0] + [1.0] * (n - 1)))
    return out


def _sdk_datums(batch):
    return [types.Datum(model_input=types.ModelInput.from_ints(tokens),
                        loss_fn_inputs={"target_tokens": targets, "weights": weights})
            for tokens, targets, weights in batch]


def _engine_datums(batch):
    return [Datum(tokens, {"target_tokens": torch.tensor(targets), "weights": torch.tensor(weights)})
            for tokens, targets, weights in batch]


def test_a_training_client_computes_over_http_what_the_engine_computes_in_process(served):
    training = served.client().create_lora_training_client(base_model=served.base, rank=4, seed=3).result()
    local = Engine.load(served.base)
    local.create("local", AdapterConfig(rank=4, seed=3, train_unembed=True))
    for step in range(3):
        batch = _batch(step)
        remote = training.forward_backward(_sdk_datums(batch), "cross_entropy").result()
        (expected,) = local.forward_backward([Pass("local", _engine_datums(batch), "cross_entropy")])
        for out, logp in zip(remote.loss_fn_outputs, expected.logprobs, strict=True):
            assert torch.allclose(torch.tensor(out["logprobs"].tolist()), logp, atol=TOL)
        assert remote.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], abs=1e-4)
        metrics = training.optim_step(types.AdamParams(**ADAM)).result().metrics
        local_metrics = local.optim_step("local", EngineAdam(**ADAM))
        assert metrics["grad_norm:mean"] == pytest.approx(local_metrics["grad_norm:mean"], rel=1e-4)
    assert expected.metrics["loss:sum"] > 0


def test_a_saved_state_resumes_exactly_and_is_the_project_s_own(served):
    client = served.client()
    training = client.create_lora_training_client(base_model=served.base, rank=4, seed=1).result()

    def step(tc, seed):
        out = tc.forward_backward(_sdk_datums(_batch(seed)), "cross_entropy").result()
        tc.optim_step(types.AdamParams(**ADAM)).result()
        return out.metrics["loss:sum"]

    step(training, 0)
    saved = training.save_state("one").result().path
    assert saved == f"tinker://{training.model_id}/weights/one"
    continued = [step(training, s) for s in (1, 2)]
    resumed = client.create_training_client_from_state_with_optimizer(saved).result()
    assert [step(resumed, s) for s in (1, 2)] == pytest.approx(continued, abs=1e-5)
    fresh = client.create_training_client_from_state(saved).result()  # weights only: the moments start anew
    assert [step(fresh, s) for s in (1, 2)][1] != pytest.approx(continued[1], abs=1e-7)
    with pytest.raises(Exception, match="no checkpoint|not found|404"):
        served.client(other=True).create_training_client_from_state(saved).result()
