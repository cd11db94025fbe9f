"""A resident job interrupted mid-run on the shared base and rebuilt there from its own checkpoint (the shared
worker drops a job it can no longer hold and claims it again later) ends where its uninterrupted run ends: its
adapter, optimizer state and data position all come back (worker/multi/checkpoints.py `restore`), while a
neighbour stays resident throughout."""

from __future__ import annotations

import torch

from worker.checkpoints.checkpoint import checkpoint_name
from worker.multi.cycle import run_cycle, start_jobs
from worker.multi.job import ResidentJob
from worker.multi.lora import SharedBase
from worker.toy.task import reward as toy_reward
from worker.trainer.loop import Trainer

from tests.specs import job_spec

from tests.worker.multi.conftest import record_sampled, toy_base
from tests.worker.multi.test_resident_jobs import Recorder, _adapter, _early_letters, resident_spec

CPU = torch.device("cpu")


def _until_done(shared, jobs):
    while live := [job for job in jobs if not job.done]:
        assert run_cycle(shared, live, device=CPU) == {}


def test_an_interrupted_resident_job_resumes_on_the_shared_base_where_it_would_have_been(toy_dir, tokenizer, tmp_path):
    spec = resident_spec(toy_dir, steps=4, checkpoint_interval=2, eval_interval=4, preflight_groups=0)
    neighbour = resident_spec(toy_dir, seed=5, steps=4, lr=1e-2, eval_interval=4)

    def jobs_on(shared, root, **kwargs):
        return (ResidentJob(spec, root / "x", shared, tokenizer, CPU, name="x", reward_fn=toy_reward,
                            callbacks=Recorder(), **kwargs),
                ResidentJob(neighbour, root / "n", shared, tokenizer, CPU, name="n", reward_fn=_early_letters,
                            callbacks=Recorder()))

    whole_base = SharedBase(toy_base(toy_dir))
    whole, whole_neighbour = jobs_on(whole_base, tmp_path / "whole")
    assert start_jobs(whole_base, [whole, whole_neighbour], device=CPU) == {}
    _until_done(whole_base, [whole, whole_neighbour])

    base = SharedBase(toy_base(toy_dir))
    first, other = jobs_on(base, tmp_path / "cut")
    assert start_jobs(base, [first, other], device=CPU) == {}
    for _ in range(2):  # to its step-2 checkpoint, then interrupted
        assert run_cycle(base, [first, other], device=CPU) == {}
    assert first.step == 2 and first.last_checkpoint.name == checkpoint_name(2)
    first.close()
    assert "x" not in base.specs and "n" in base.specs
    assert run_cycle(base, [other], device=CPU) == {}  # the neighbour goes on alone meanwhile

    again = ResidentJob(spec, tmp_path / "cut" / "x", base, tokenizer, CPU, name="x", reward_fn=toy_reward,
                        callbacks=Recorder())
    assert again.step == 2
    assert start_jobs(base, [again], device=CPU) == {}
    _until_done(base, [again, other])
    assert [s for s, _ in again.callbacks.steps] == [3, 4]

    got, want = _adapter(again.last_checkpoint), _adapter(whole.last_checkpoint)
    assert set(got) == set(want)
    diff = max(float((got[k] - want[k]).abs().max()) for k in got)
    # the batched update's bound per optimizer step (tests/worker/multi/test_batched_update.py), over every step
    assert diff <= 1e-3 * spec.optimizer.lr * spec.training.steps * spec.training.mini_batches, diff
    at_cut = _adapter(first.last_checkpoint)
    assert max(float((got[k] - at_cut[k]).abs().max()) for k in got) > 100 * diff + 1e-5  # it trained after
    # the neighbour, never interrupted, is untouched by the other job's leaving and coming back
    mine, theirs = _adapter(other.last_checkpoint), _adapter(whole_neighbour.last_checkpoint)
    bound = 1e-3 * neighbour.optimizer.lr * neighbour.training.steps * neighbour.training.mini_batches
    assert max(float((mine[k] - theirs[k]).abs().max()) for k in mine) <= bound


class _StopAt(Recorder):
    def __init__(self, step):
        super().__init__()
        self.at = step

    def on_step(self, step, metrics):
        super().on_step(step, metrics)
        self.stop = step == self.at


def test_an_asynchronous_resident_job_resumes_as_it_resumes_alone(toy_dir, tokenizer, tmp_path, monkeypatch):
    """rollout.max_staleness 1, fixed_lag: interrupted at its step-2 checkpoint and rebuilt on the shared base, it
    samples step 3 with the version it resumed at (the stale versions are not in a checkpoint: alone, the resumed
    sampler starts from the checkpoint's weights too) and ends where the job alone, interrupted and resumed at the
    same step, ends."""
    sampled, _ = record_sampled(monkeypatch)
    spec = job_spec(resident_spec(toy_dir, steps=4, checkpoint_interval=2, eval_interval=0,
                                  preflight_groups=0).model_dump(mode="json"),
                    rollout={"max_staleness": 1, "version_policy": "fixed_lag"})
    neighbour = resident_spec(toy_dir, seed=5, steps=4, lr=1e-2, eval_interval=0)
    base = SharedBase(toy_base(toy_dir))
    first = ResidentJob(spec, tmp_path / "shared", base, tokenizer, CPU, name="x", reward_fn=toy_reward,
                        callbacks=Recorder())
    other = ResidentJob(neighbour, tmp_path / "n", base, tokenizer, CPU, name="n", reward_fn=_early_letters,
                        callbacks=Recorder())
    assert start_jobs(base, [first, other], device=CPU) == {}
    for _ in range(2):
        assert run_cycle(base, [first, other], device=CPU) == {}
    first.close()
    assert {"x", "x~sampling"}.isdisjoint(base.specs)  # its sampling copy leaves with it
    again = ResidentJob(spec, tmp_path / "shared", base, tokenizer, CPU, name="x", reward_fn=toy_reward,
                        callbacks=Recorder())
    assert again.step == 2 and start_jobs(base, [again], device=CPU) == {}
    _until_done(base, [again, other])
    lags = [m["policy_lag_max"] for _, m in first.callbacks.steps + again.callbacks.steps]
    assert lags == [0.0, 1.0, 0.0, 1.0]  # steps 1 and 3 (resumed) sample the version they start at

    cut = Trainer(spec, tmp_path / "alone", reward_fn=toy_reward)
    cut.run(_StopAt(2))
    resumed = Trainer(spec, tmp_path / "alone", reward_fn=toy_reward)
    assert resumed.step == 2
    result = resumed.run(Recorder())
    assert sampled[first] + sampled[again] == sampled[cut] + sampled[resumed]  # the same tokens, step by step
    got, want = _adapter(again.last_checkpoint), _adapter(result.last_checkpoint)
    diff = max(float((got[k] - want[k]).abs().max()) for k in got)
    assert diff <= 1e-3 * spec.optimizer.lr * spec.training.steps * spec.training.mini_batches, diff
