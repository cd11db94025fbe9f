"""Whole jobs resident on one base, advanced by cycles, end where each job alone ends (worker/trainer/loop.py).

The toy task, two to three cycles; the jobs differ in seed, LoRA rank and targets, learning rate, group size and
reward. The bound is the batched update's (tests/multi/test_batched_update.py): 1e-3 * lr per optimizer step.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from service.job_spec.spec import JobSpec
from worker.multi.cycle import run_cycle
from worker.multi.job import ResidentJob
from worker.multi.lora import SharedBase
from worker.toy.__main__ import toy_spec
from worker.toy.task import reward as toy_reward
from worker.trainer.loop import Trainer

from tests.multi.conftest import toy_base

CPU = torch.device("cpu")


def _spec(toy_dir, *, seed=0, lr=3e-3, lora=None, **training) -> JobSpec:
    raw = toy_spec(toy_dir)
    raw["seed"] = seed
    raw["optimizer"] = {"lr": lr}
    if lora:
        raw["lora"] = lora
    raw["training"].update({"steps": 3, "batch_size": 2, "group_size": 4, "mini_batches": 2, "micro_batch_size": 4,
                            "eval_interval": 2, "eval_max_rows": 4, "checkpoint_interval": 2, "preflight_groups": 1,
                            **training})
    return JobSpec.model_validate(raw)


def _early_letters(completion: str, answer: str, **_row) -> float:
    return float(completion.strip()[:1] in ("a", "b", "c"))  # another reward: a completion starting with a-c


def _adapter(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))


class Recorder:
    def __init__(self):
        self.steps, self.evals, self.checkpoints, self.stop = [], [], [], False

    def on_step(self, step, metrics):
        self.steps.append((step, metrics))

    def on_eval(self, step, metrics):
        self.evals.append((step, metrics))

    def on_checkpoint(self, step, path):
        self.checkpoints.append((step, path))

    def should_stop(self):
        return self.stop


def test_jobs_on_one_base_end_where_each_ends_alone(toy_dir, tokenizer, tmp_path):
    specs = {
        "job-a": (_spec(toy_dir), toy_reward),
        "job-b": (_spec(toy_dir, seed=7, lr=1e-2, lora={"r": 4, "alpha": 4, "target_modules": ["q_proj", "v_proj"]},
                    group_size=2, mini_batches=1), _early_letters),
        "job-c": (_spec(toy_dir, seed=3, steps=2), toy_reward),
    }
    shared = SharedBase(toy_base(toy_dir))
    jobs = {name: ResidentJob(spec, tmp_path / f"shared-{name}", shared, tokenizer, CPU, name=name, reward_fn=fn,
                              callbacks=Recorder()) for name, (spec, fn) in specs.items()}
    start = {name: {k: v.clone() for k, v in shared.adapter_state(name).items()} for name in jobs}
    for job in jobs.values():
        job.start()
    while live := [job for job in jobs.values() if not job.done]:
        assert run_cycle(shared, live, device=CPU) == {}
    for name, (spec, fn) in specs.items():
        alone = Recorder()
        result = Trainer(spec, tmp_path / f"alone-{name}", reward_fn=fn).run(alone)
        mine = jobs[name].callbacks
        assert [s for s, _ in mine.steps] == [s for s, _ in alone.steps] == list(range(1, spec.training.steps + 1))
        for (_, got), (_, want) in zip(mine.steps, alone.steps):
            assert got["reward_mean"] == want["reward_mean"], name  # the same samples, scored the same
            assert got["completion_length_mean"] == want["completion_length_mean"], name
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-7), name
        assert [s for s, _ in mine.evals] == [s for s, _ in alone.evals]
        for (_, got), (_, want) in zip(mine.evals, alone.evals):
            assert got["eval_reward_mean"] == want["eval_reward_mean"], name
        got, want = _adapter(jobs[name].last_checkpoint), _adapter(result.last_checkpoint)
        assert set(got) == set(want)
        diff = max(float((got[k] - want[k]).abs().max()) for k in got)
        steps = spec.training.steps * spec.training.mini_batches
        print(f"job {name}: max |shared - alone| = {diff:.2e}")
        assert diff <= 1e-3 * spec.optimizer.lr * steps, name
        travelled = max(float((got[k] - start[name][k]).abs().max()) for k in got)
        assert travelled > 100 * diff + 1e-5, name  # it trained


def test_a_resident_job_resumes_from_its_checkpoint_like_a_job_alone(toy_dir, tokenizer, tmp_path):
    """A shared worker's checkpoint is an ordinary one: a job alone resumes from it (and so a job moves between
    kinds of worker), reaching the uninterrupted run's adapter."""
    spec = _spec(toy_dir, steps=3, checkpoint_interval=1, preflight_groups=0)
    shared = SharedBase(toy_base(toy_dir))
    job = ResidentJob(spec, tmp_path / "run", shared, tokenizer, CPU, name="x", reward_fn=toy_reward,
                      callbacks=Recorder())
    job.start()
    assert run_cycle(shared, [job], device=CPU) == {}
    job.close()
    assert "x" not in shared.specs
    resumed = Trainer(spec, tmp_path / "run", reward_fn=toy_reward).run(Recorder())
    whole = Trainer(spec, tmp_path / "whole", reward_fn=toy_reward).run(Recorder())
    got, want = _adapter(resumed.last_checkpoint), _adapter(whole.last_checkpoint)
    assert max(float((got[k] - want[k]).abs().max()) for k in got) <= 1e-3 * spec.optimizer.lr * 6
