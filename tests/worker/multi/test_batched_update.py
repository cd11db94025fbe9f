"""One cycle's update over several jobs (one forward/backward per combined micro-batch) leaves each job's adapter
where the existing Updater leaves that job trained alone.

Alone is worker/trainer/update.py's Updater on a PeftModel holding only that job's adapter, with its own AdamW.
The jobs differ in LoRA rank, scale and target modules, learning rate, group size, micro-batch size,
mini-batches, update epochs (so logp_old comes from a frozen forward), KL term (reference = the base alone),
loss normalisation, gradient clipping and advantages (their rewards).

The bound, and why: the shared and the alone run do the same float32 arithmetic per row, but the combined
batch is padded to its longest row, its matmuls have other shapes, and the alone Updater scores a group's shared
prompt once (prefix sharing), so sums are taken in other orders. Reordering a float32 sum of n terms moves it by
at most ~n * 2^-24 of the sum of the terms' magnitudes: ~1e-6 relative for most gradient entries, more for an
entry whose per-token terms nearly cancel (advantages of both signs). Adam's step is lr * m / (sqrt(v) + eps),
at most ~lr per entry, and its direction carries the gradient's relative error, so one optimizer step moves an
entry by at most lr * (that error). Asserted: |w_shared - w_alone| <= 1e-3 * lr * optimizer steps, a thousandth
of what one step may move an entry (measured here: at most ~1e-4 * lr * steps, printed). Adam hides the gradient's
scale, so the losses and gradient norms of every optimizer step are compared too (relative 1e-4): a wrong
normaliser or a gradient leaking between jobs changes those by far more.
"""

from __future__ import annotations

import pytest
import torch

from service.job_spec.spec import JobSpec
from tests.specs import job_spec
from worker.multi.rollout import RolloutRequest, generate_jobs
from worker.multi.update import JobUpdate, batched_update
from worker.toy.__main__ import toy_spec
from worker.model.policy import Policy
from worker.model.streams import stream_seed
from worker.trainer.update import Updater

from tests.worker.multi.conftest import alone, shared_with_adapters

CPU = torch.device("cpu")


def adapter_spec(toy_dir, lora: dict, *, lr: float, training: dict, loss: dict | None = None, max_grad_norm=1.0,
          seed: int = 0, temperature: float = 1.0) -> JobSpec:
    return job_spec(toy_spec(toy_dir), seed=seed, lora=lora, optimizer={"lr": lr, "max_grad_norm": max_grad_norm},
                    loss=loss or {}, sampling={"temperature": temperature, "max_output_tokens": 5},
                    training={"steps": 3, "eval_interval": 0, "checkpoint_interval": 0, **training})


def _jobs(toy_dir) -> dict[str, JobSpec]:
    return {
        "job-a": adapter_spec(toy_dir, {"r": 4, "alpha": 8, "target_modules": "all-linear"}, lr=3e-3,
                       training={"batch_size": 2, "group_size": 4, "mini_batches": 1, "micro_batch_size": 8}),
        "job-b": adapter_spec(toy_dir, {"r": 8, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}, lr=1e-2, seed=5,
                       temperature=0.7, loss={"normalization": "sequence"},
                       training={"batch_size": 3, "group_size": 2, "mini_batches": 2, "micro_batch_size": 2,
                                 "update_epochs": 2}),
        "job-c": adapter_spec(toy_dir, {"r": 2, "alpha": 16, "target_modules": ["o_proj", "down_proj"]}, lr=5e-4,
                       seed=9, loss={"kl_beta": 0.1, "normalization": "prompt"}, max_grad_norm=0.05,
                       training={"batch_size": 2, "group_size": 3, "mini_batches": 1, "micro_batch_size": 4}),
        "job-d": adapter_spec(toy_dir, {"r": 4, "alpha": 8, "target_modules": "all-linear"}, lr=3e-3, seed=3,
                       training={"batch_size": 2, "group_size": 4, "mini_batches": 2, "micro_batch_size": 3}),
    }


def _rows(toy_dir, start, n):
    import json

    lines = (toy_dir / "train.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[start : start + n]]


def _optimizer(params, spec):
    opt = spec.optimizer
    return torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)


@pytest.mark.parametrize("steps", [1, 3])
def test_each_adapter_equals_its_job_trained_alone(toy_dir, tokenizer, steps):
    specs = _jobs(toy_dir)
    shared = shared_with_adapters(toy_dir, {name: spec.lora for name, spec in specs.items()})
    alones = {name: alone(toy_dir, shared, name) for name in specs}  # the same starting adapters
    start = {name: {k: v.clone() for k, v in shared.adapter_state(name).items()} for name in specs}
    # job-d draws job-c's prompts: their rows must never share a prompt pass (their adapters differ).
    requests = [RolloutRequest(name, _rows(toy_dir, 9 * min(k, 2), spec.training.batch_size), spec.sampling,
                               spec.training.group_size,
                               sampling_seeds=[stream_seed("sample", spec.seed, 0, p)
                                               for p in range(spec.training.batch_size)])
                for k, (name, spec) in enumerate(specs.items())]
    rollouts = dict(zip(specs, generate_jobs(shared, tokenizer, CPU, requests)))
    advantages = {name: torch.randn(len(rollouts[name]), generator=torch.Generator().manual_seed(k))
                  for k, name in enumerate(specs)}  # each job's own rewards
    shared_opts = {name: _optimizer(shared.parameters(name), spec) for name, spec in specs.items()}
    policies = {name: Policy(alones[name], tokenizer, CPU) for name in specs}
    updaters = {name: Updater(policies[name], _optimizer(policies[name].trainable_parameters(), spec), spec)
                for name, spec in specs.items()}
    optimizer_steps = {name: 0 for name in specs}
    for step in range(steps):
        stats = batched_update(shared, [
            JobUpdate(name, spec, shared_opts[name], shared.parameters(name), rollouts[name], advantages[name],
                      list(range(len(rollouts[name]))), step) for name, spec in specs.items()],
            pad_id=tokenizer.pad_token_id, device=CPU)
        for (name, spec), got in zip(specs.items(), stats):
            want = updaters[name].run(rollouts[name], advantages[name], list(range(len(rollouts[name]))), step=step)
            assert len(got.grad_norms) == len(want.grad_norms) > 0
            assert got.grad_norms == pytest.approx(want.grad_norms, rel=1e-4), name
            assert got.step_losses == pytest.approx(want.step_losses, rel=1e-4, abs=1e-7), name
            optimizer_steps[name] += len(want.grad_norms)
    for name, spec in specs.items():
        want = {k: v for k, v in alones[name].named_parameters() if "lora_" in k}
        got = shared.adapter_state(name)
        want = {k: v.detach() for k, v in want.items()}
        assert set(got) == {k.replace(".default.", ".") for k in want}
        diff = max(float((got[k.replace(".default.", ".")] - v).abs().max()) for k, v in want.items())
        bound = 1e-3 * spec.optimizer.lr * optimizer_steps[name]
        print(f"{name}: max |shared - alone| = {diff:.2e} (bound {bound:.2e}, lr {spec.optimizer.lr})")
        assert diff <= bound, name
        travelled = max(float((got[k] - start[name][k]).abs().max()) for k in got)
        assert travelled > 100 * bound, name  # the adapter really trained


def test_a_prompt_two_jobs_sampled_is_held_once_per_job(toy_dir):
    """As alone, each job's group shares its prompt pass; a prompt both jobs drew is two prefixes (one per adapter),
    and a collision no longer costs the whole micro-batch its prefix sharing."""
    from types import SimpleNamespace

    from worker.multi.routed import collate_rows

    prompt, other = [5, 6, 7], [8, 9]

    def job(name, prompts):
        seqs = [p + [10 + c, 2] for p in prompts for c in range(2)]
        masks = [[0] * len(p) + [1, 1] for p in prompts for _ in range(2)]
        return SimpleNamespace(name=name, rollout=SimpleNamespace(token_ids=seqs, action_mask=masks))

    a, b = job("job-a", [prompt, other]), job("job-b", [prompt])
    parts = [(a, [0, 1, 2, 3]), (b, [0, 1])]
    batch = collate_rows([j.rollout.token_ids[i] for j, m in parts for i in m],
                         [j.rollout.action_mask[i] for j, m in parts for i in m],
                         [j.name for j, m in parts for _ in m], pad_id=0, device=CPU)
    assert batch.prefix_of_B is not None
    assert batch.prefix_of_B.tolist() == [0, 0, 1, 1, 2, 2]  # job-a's two prompts, then job-b's own copy
    assert batch.prefix_ids_GP[0].tolist() == batch.prefix_ids_GP[2].tolist() == [5, 6]


def test_an_update_that_needs_no_frozen_logprobs_switches_the_model_mode_once(toy_dir, tokenizer, monkeypatch):
    """Switching train/eval walks every module (hundreds, more with each adapter): a cycle with no KL term and one
    update per rollout (the defaults) must not pay two round trips for frozen log-probs it does not compute."""
    specs = {name: spec for name, spec in _jobs(toy_dir).items() if name in ("job-a", "job-d")}
    specs["job-d"] = specs["job-d"].model_copy(update={"training": specs["job-d"].training.model_copy(
        update={"mini_batches": 1})})
    assert all(s.training.updates_per_rollout == 1 and s.loss.kl_beta == 0 for s in specs.values())
    shared = shared_with_adapters(toy_dir, {name: spec.lora for name, spec in specs.items()})
    requests = [RolloutRequest(name, _rows(toy_dir, 0, spec.training.batch_size), spec.sampling,
                               spec.training.group_size, sampling_seeds=[1, 2]) for name, spec in specs.items()]
    rollouts = dict(zip(specs, generate_jobs(shared, tokenizer, CPU, requests)))
    switches = []
    switch = shared.set_training
    monkeypatch.setattr(shared, "set_training", lambda mode: switches.append(mode) or switch(mode))
    batched_update(shared, [
        JobUpdate(name, spec, _optimizer(shared.parameters(name), spec), shared.parameters(name), rollouts[name],
                  torch.randn(len(rollouts[name])), list(range(len(rollouts[name]))), 0)
        for name, spec in specs.items()], pad_id=tokenizer.pad_token_id, device=CPU)
    assert switches == [True]
