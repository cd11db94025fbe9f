"""The Tinker losses (worker/engine/losses.py) through the real SDK and API: cross_entropy is the job trainer's
supervised loss (worker/trainer/supervised.py) on the same batch, and importance_sampling, ppo and cispo are
their formulas, written out here in plain Python over the log-probs the server returns.

Tinker's losses are sums over a call's target tokens; the job's supervised loss is a token mean over the step's
target tokens. Both are compared as sums: the job's mean times its target count."""

from __future__ import annotations

import math

import pytest
import torch

from service.repositories import projects
from tests.specs import job_spec
from worker.checkpoints.checkpoint import load_checkpoint
from worker.engine import AdapterConfig
from worker.engine.engine import lora_spec
from worker.model.policy import load_policy
from worker.toy.__main__ import toy_spec
from worker.trainer import supervised

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

TOL = 1e-5
RANK, SEED = 4, 3
STEP = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
# A step that reports the gradient's norm and leaves the weights as they are: the API refuses lr 0, and Adam's
# updates of about lr are far below a float32 weight's resolution.
NO_STEP = {"learning_rate": 1e-30, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
           "grad_clip_norm": 0.0}


def _examples() -> list[supervised.Example]:
    """Three sequences of the toy vocabulary, prompt tokens weighted 0 and completion tokens 1, as the job's
    supervised rows are (the first token is never a target)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for prompt, completion in ((4, 3), (6, 2), (3, 5)):
        ids = torch.randint(4, 40, (prompt + completion,), generator=g).tolist()
        out.append(supervised.Example(ids, [0] * prompt + [1] * completion))
    return out


def _sdk_datum(tokens: list[int], targets: list[int], **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": targets, **inputs})


def _as_sdk(example: supervised.Example) -> types.Datum:
    """Predicting token t from tokens < t: the model input drops the last token, the targets the first."""
    ids, mask = example.token_ids, example.target_mask
    return _sdk_datum(ids[:-1], ids[1:], weights=[float(m) for m in mask[1:]])


def _logprobs(out) -> list[list[float]]:
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def _job_loss(spec, examples, warm_start=None) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The supervised job's step loss (its token mean, measured before the step's update: lr 0 here) and its
    per-token log-probs and target mask (0 at positions that are not targets), through its own scoring path."""
    torch.manual_seed(SEED)
    policy = load_policy(spec, resume_from=None, warm_start=warm_start)
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=0.0)
    stats = supervised.supervised_step(policy, optimizer, examples, micro_batch_size=2, chunk_size=4,
                                       max_grad_norm=None)
    logp_BT, mask_BT = supervised._logprobs(policy, examples, 4)
    lora_b = [p for n, p in policy.model.named_parameters() if "lora_B" in n and p.requires_grad]
    stats["lora_b_zero"] = bool(lora_b) and all(not p.any() for p in lora_b)
    return stats, logp_BT.detach(), mask_BT


def _assert_same(remote, job, logp_BT, mask_BT, examples) -> None:
    targets = sum(sum(e.target_mask) for e in examples)
    assert job["target_tokens"] == targets == 10
    got = _logprobs(remote)
    for b, (example, row) in enumerate(zip(examples, got, strict=True)):
        assert len(row) == len(example.token_ids) - 1
        weighted = [t for t, m in enumerate(example.target_mask[1:]) if m]
        assert mask_BT[b, weighted].all() and int(mask_BT[b].sum()) == len(weighted)
        for t in weighted:
            assert row[t] == pytest.approx(float(logp_BT[b, t]), abs=TOL)
            assert row[t] < 0
    # Tinker's loss:sum = -sum(weights * logprobs); the job's loss is that sum / its target tokens.
    assert remote.metrics["loss:sum"] == pytest.approx(job["loss"] * targets, abs=TOL)
    assert remote.metrics["loss:sum"] == pytest.approx(
        -sum(row[t] * m for row, e in zip(got, examples) for t, m in enumerate(e.target_mask[1:])), abs=TOL)


def test_cross_entropy_is_the_job_trainer_s_supervised_loss(served, toy_dir):
    """A fresh adapter over HTTP and a supervised job's policy with the same LoRA (rank, scale, modules): the
    target tokens' log-probs agree one by one, and loss:sum is the job's token-mean loss times its target count.

    At the start both adapters are PEFT's initialisation, whose B is zero: each computes exactly its base model
    (the engine's adapter lives on a shared, routed base; the job's is a PeftModel). After a step over HTTP the
    adapter is no longer a no-op; its saved state, warm-starting the job, gives the job the same loss again."""
    examples = _examples()
    datums = [_as_sdk(e) for e in examples]
    training = served.client().create_lora_training_client(base_model=served.base, rank=RANK, seed=SEED).result()
    remote = training.forward_backward(datums, "cross_entropy").result()

    lora = lora_spec(AdapterConfig(rank=RANK, seed=SEED, train_unembed=True))  # the SDK's default train_unembed
    spec = job_spec(toy_spec(toy_dir), method="supervised", reward=None, dtype="float32",
                    lora={"r": lora.r, "alpha": lora.alpha, "target_modules": lora.target_modules})
    job, logp_BT, mask_BT = _job_loss(spec, examples)
    assert job["lora_b_zero"]  # the job's adapter is a no-op at its start
    _assert_same(remote, job, logp_BT, mask_BT, examples)

    training.optim_step(types.AdamParams(**STEP)).result()
    stepped = training.forward(datums, "cross_entropy").result()
    assert stepped.metrics["loss:sum"] < remote.metrics["loss:sum"] - 0.1  # a step down this very loss
    saved = training.save_state("stepped").result().path
    with served.runner.sessions() as s:
        project_id = projects.get_or_create_project(s, "alpha").id
    local, _ = served.runner.calls.checkpoints.fetch(project_id, saved)
    job, logp_BT, mask_BT = _job_loss(spec, examples, warm_start=load_checkpoint(local))
    assert not job["lora_b_zero"]
    _assert_same(stepped, job, logp_BT, mask_BT, examples)


# The small case of the RL losses: two datums of four target tokens, each token's ratio exp(p - q) and advantage
# chosen by hand, well clear of every clip threshold used below, so each branch of each formula is taken somewhere.
RATIOS = [[0.5, 0.9, 1.1, 1.5], [0.7, 1.0, 1.3, 6.0]]
ADVANTAGES = [[1.0, -1.0, 2.0, -0.5], [-1.5, 0.5, 1.0, 0.25]]


def _f32(values: list[float]) -> list[float]:
    """The values as float32 sends them (the wire's dtype), so the hand computation uses what the server reads."""
    return torch.tensor(values, dtype=torch.float32).tolist()


def _small_case(training) -> tuple[list[types.Datum], list[list[float]], list[list[float]]]:
    """(datums, sampling log-probs q, advantages): q = p - log(ratio), p the current log-probs of the targets."""
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(4, 40, (5,), generator=g).tolist() for _ in RATIOS]
    probe = training.forward([_sdk_datum(s[:-1], s[1:]) for s in seqs], "cross_entropy").result()
    qs = [_f32([p - math.log(r) for p, r in zip(row, ratios)]) for row, ratios in zip(_logprobs(probe), RATIOS)]
    advantages = [_f32(a) for a in ADVANTAGES]
    datums = [_sdk_datum(s[:-1], s[1:], logprobs=q, advantages=a) for s, q, a in zip(seqs, qs, advantages)]
    return datums, qs, advantages


def _tokens(ps, qs, advantages):
    """(p, ratio, A) of every target token of the call, datum after datum."""
    for p_row, q_row, a_row in zip(ps, qs, advantages, strict=True):
        for p, q, a in zip(p_row, q_row, a_row, strict=True):
            yield p, math.exp(p - q), a


def _is(ps, qs, advantages) -> float:
    return -sum(r * a for _, r, a in _tokens(ps, qs, advantages))


def _ppo(ps, qs, advantages, low: float, high: float) -> float:
    return -sum(min(r * a, min(max(r, low), high) * a) for _, r, a in _tokens(ps, qs, advantages))


def _cispo(ps, qs, advantages, high: float) -> float:
    """-sum(sg(min(ratio, high)) * A * p): the weight is clipped from above only, the log-prob carries the gradient."""
    return -sum(min(r, high) * a * p for p, r, a in _tokens(ps, qs, advantages))


def test_importance_sampling_ppo_and_cispo_are_their_formulas(served):
    training = served.client().create_lora_training_client(base_model=served.base, rank=RANK, seed=SEED).result()
    datums, qs, advantages = _small_case(training)

    def call(loss_fn, config=None):
        out = training.forward_backward(datums, loss_fn, config).result()
        ps = _logprobs(out)
        ratios = [math.exp(p - q) for p_row, q_row in zip(ps, qs) for p, q in zip(p_row, q_row)]
        assert ratios == pytest.approx([r for row in RATIOS for r in row], rel=1e-4)  # the case is as chosen
        return out.metrics, ps

    metrics, ps = call("importance_sampling")
    assert metrics["loss:sum"] == pytest.approx(_is(ps, qs, advantages), rel=TOL, abs=TOL)

    # PPO's defaults are Tinker's: ratios clipped to [0.8, 1.2]. Five of the eight ratios lie outside it.
    metrics, ps = call("ppo")
    assert metrics["loss:sum"] == pytest.approx(_ppo(ps, qs, advantages, 0.8, 1.2), rel=TOL, abs=TOL)
    assert metrics["clipped:sum"] == 5
    metrics, ps = call("ppo", {"clip_low_threshold": 0.6, "clip_high_threshold": 1.4})
    assert metrics["loss:sum"] == pytest.approx(_ppo(ps, qs, advantages, 0.6, 1.4), rel=TOL, abs=TOL)
    assert metrics["clipped:sum"] == 3  # 0.5, 1.5 and 6.0

    # CISPO's default upper bound is the job loss's ratio_max, 5 (absolute); only 6.0 is above it.
    metrics, ps = call("cispo")
    assert metrics["loss:sum"] == pytest.approx(_cispo(ps, qs, advantages, 5.0), rel=TOL, abs=TOL)
    assert metrics["clipped:sum"] == 1
    metrics, ps = call("cispo", {"clip_high_threshold": 1.2})
    assert metrics["loss:sum"] == pytest.approx(_cispo(ps, qs, advantages, 1.2), rel=TOL, abs=TOL)
    assert metrics["clipped:sum"] == 3  # 1.5, 1.3 and 6.0
    with pytest.raises(Exception, match="clips the importance weight from above only"):
        training.forward_backward(datums, "cispo", {"clip_low_threshold": 0.8}).result()

    # The four formulas differ, here by more than the tolerance, so none of the checks above passes for another.
    values = [_is(ps, qs, advantages), _ppo(ps, qs, advantages, 0.8, 1.2), _ppo(ps, qs, advantages, 0.6, 1.4),
              _cispo(ps, qs, advantages, 5.0), _cispo(ps, qs, advantages, 1.2)]
    assert min(abs(a - b) for i, a in enumerate(values) for b in values[i + 1:]) > 1e-2


def test_a_ppo_datum_clipped_throughout_has_no_gradient_and_cispo_s_has_one(served):
    """Where every ratio is past the clip on the side its advantage pushes (above 1.2 with A > 0, below 0.8 with
    A < 0), PPO's objective is the constant clip(r) * A: no gradient. CISPO clips the weight, not the update, so
    each of those tokens still has a gradient, and importance sampling clips nothing. (CISPO's gradient is importance
    sampling's, -A * ratio * grad p per token, wherever the ratio is below its upper bound: the 6.0 here tells them
    apart.)"""
    training = served.client().create_lora_training_client(base_model=served.base, rank=RANK, seed=SEED).result()
    g = torch.Generator().manual_seed(13)
    seqs = [torch.randint(4, 40, (5,), generator=g).tolist() for _ in range(2)]
    probe = training.forward([_sdk_datum(s[:-1], s[1:]) for s in seqs], "cross_entropy").result()
    ratios, advantages = [[1.5, 2.0, 0.5, 0.6], [0.7, 1.3, 6.0, 0.4]], [[1.0, 0.5, -1.0, -2.0], [-1.0, 1.0, 2.0, -0.5]]
    datums = [_sdk_datum(s[:-1], s[1:], logprobs=_f32([p - math.log(r) for p, r in zip(row, rs)]), advantages=a)
              for s, row, rs, a in zip(seqs, _logprobs(probe), ratios, advantages)]

    def grad_norm(loss_fn) -> float:
        out = training.forward_backward(datums, loss_fn).result()
        assert out.metrics["loss:sum"] != 0
        return training.optim_step(types.AdamParams(**NO_STEP)).result().metrics["grad_norm:mean"]

    assert grad_norm("ppo") == 0.0
    cispo, importance_sampling = grad_norm("cispo"), grad_norm("importance_sampling")
    assert cispo > 1e-3 and importance_sampling > 1e-3
    assert cispo != pytest.approx(importance_sampling, rel=1e-3)
    assert grad_norm("ppo") == 0.0  # no step changed a weight: the case is still clipped throughout
