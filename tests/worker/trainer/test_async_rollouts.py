"""Asynchronous CISPO (rollout.max_staleness > 0) on the tiny model: the sampler process, version lag, the ratio
against the sampler's log-probs, and the child process gone on every exit path."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest
import torch
from pydantic import ValidationError

from service.job_spec.objective import STALE_BATCH_MASK
from service.job_spec.spec import JobSpec
from tests.specs import job_spec
from service.schemas.recipe import OffPolicyMaskSpec
from worker.checkpoints.checkpoint import load_checkpoint
from worker.rollout.async_sampler import SamplerDied
from worker.rollout.policy_versions import fresh_sequences
from worker.toy.__main__ import toy_spec
from worker.trainer import pipeline as pipeline_module
from worker.trainer.loop import Trainer
from worker.model.policy import load_policy
from worker.rollout.rollout import Rollout
from worker.trainer.update import Updater


def async_spec(toy_dir: Path, max_staleness: int, version_policy: str = "newest", **training) -> JobSpec:
    """A 4-step toy job at `max_staleness`; tests that assert which version sampled a batch take 'fixed_lag' (under
    'newest' a sampler that wakes late on a loaded machine may already hold the next version)."""
    return job_spec(toy_spec(toy_dir), rollout={"max_staleness": max_staleness, "version_policy": version_policy},
                    training={"steps": 4, "batch_size": 4, "group_size": 4, "mini_batches": 2, "micro_batch_size": 4,
                              "eval_interval": 0, "eval_max_rows": 8, "checkpoint_interval": 0, **training})


class Recorder:
    """Callbacks that keep each step's metrics; stop (or raise) after a given step."""

    def __init__(self, stop_at: int | None = None, raise_at: int | None = None):
        self.metrics: list[dict] = []
        self.stop_at, self.raise_at = stop_at, raise_at

    def on_step(self, step, metrics):
        self.metrics.append(metrics)
        if step == self.raise_at:
            raise RuntimeError("callback failure")

    def on_eval(self, step, metrics):
        pass

    def on_checkpoint(self, step, path):
        pass

    def should_stop(self):
        return self.stop_at is not None and len(self.metrics) >= self.stop_at


@pytest.fixture
def sampler_children(monkeypatch):
    """Every sampler process the trainer starts, and the versions of the batches each step took."""
    started, taken = [], []
    real_init, real_take = pipeline_module.RolloutPipeline.__init__, pipeline_module.RolloutPipeline.take

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        started.append(self.sampler.process)

    def take(self, step):
        batch = real_take(self, step)
        taken.append((step, list(batch.versions)))
        return batch

    monkeypatch.setattr(pipeline_module.RolloutPipeline, "__init__", init)
    monkeypatch.setattr(pipeline_module.RolloutPipeline, "take", take)
    return started, taken


def assert_gone(process) -> None:
    assert not process.is_alive()
    assert not psutil.pid_exists(process.pid) or psutil.Process(process.pid).status() == psutil.STATUS_ZOMBIE


# -- units -----------------------------------------------------------------------


def test_fresh_sequences_drop_what_is_older_than_the_bound():
    fresh = fresh_sequences([5, 4, 3, 2, 5], current=5, max_staleness=2)
    assert fresh.kept == [0, 1, 2, 4] and fresh.dropped == 1
    assert fresh.lag_max == 2 and fresh.lag_mean == pytest.approx(3 / 4)
    assert fresh_sequences([1, 1], current=1, max_staleness=0).kept == [0, 1]
    with pytest.raises(ValueError, match="newer than the trainer"):
        fresh_sequences([6], current=5, max_staleness=2)


def test_a_batch_is_shared_out_by_whole_groups_with_its_errors_once():
    """FSDP ranks each get a contiguous share of rank 0's batch (prompt-major, so whole groups); the reward errors,
    not per sequence, all go with rank 0's share so the ranks' concatenation counts each once."""
    from worker.trainer.feedback import Feedback
    from worker.trainer.pipeline import ScoredBatch
    from worker.trainer.rank_pipeline import batch_share
    from worker.trainer.rewards import Scores

    n = 8
    rollout = Rollout(rows=[{"p": i // 4} for i in range(n)], token_ids=[[i] for i in range(n)],
                      action_mask=[[1]] * n, action_turns=[[0]] * n, prompt_lengths=[0] * n,
                      completions=[str(i) for i in range(n)], truncated=[False] * n, turns=[1] * n,
                      sampler_logprobs=[[-float(i)] for i in range(n)])
    scores = Scores(torch.arange(n, dtype=torch.float32), ["bad 5"], {"format": [float(i) for i in range(n)]})
    batch = ScoredBatch(3, rollout, Feedback([[float(i)] for i in range(n)], ["bad 5"], scores), [2] * 4 + [3] * 4,
                        sample_s=1.0, update_wait_s=0.5, rollout_wait_s=0.25)
    shares = [batch_share(batch, r, 2) for r in range(2)]
    assert [s.rollout.completions for s in shares] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    assert [s.rollout.rows for s in shares] == [[{"p": 0}] * 4, [{"p": 1}] * 4]
    assert shares[1].rollout.sampler_logprobs == [[-4.0], [-5.0], [-6.0], [-7.0]]
    assert shares[1].rollout.turn_rewards == [] and shares[1].rollout.errors == []  # left empty: stay so
    assert [s.versions for s in shares] == [[2] * 4, [3] * 4]
    assert [s.feedback.rewards.tolist() for s in shares] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shares[1].feedback.scores.rewards.tolist() == [4, 5, 6, 7]
    assert shares[1].feedback.scores.components == {"format": [4.0, 5.0, 6.0, 7.0]}
    assert [s.feedback.errors for s in shares] == [["bad 5"], []]
    assert [s.feedback.scores.errors for s in shares] == [["bad 5"], []]
    assert all((s.step, s.sample_s, s.update_wait_s, s.rollout_wait_s) == (3, 1.0, 0.5, 0.25) for s in shares)
    assert batch_share(batch, 0, 1) is batch


def test_spec_defaults_to_synchronous_and_takes_async_on_ray(toy_dir):
    assert JobSpec.model_validate(toy_spec(toy_dir)).rollout.max_staleness == 0
    base = toy_spec(toy_dir)
    # FSDP (rank 0 runs the sampler: worker/trainer/rank_pipeline.py), vLLM (in the sampler process) and Ray (the
    # sampler as a Ray actor of its own: worker/ray_driver/sampler_actor.py) are taken.
    for rollout, resources in (({"max_staleness": 1}, {"gpus": 2}), ({"max_staleness": 1, "engine": "vllm"}, {}),
                               ({"max_staleness": 1}, {"backend": "ray"}), ({"max_staleness": 2}, {"nodes": 2})):
        spec = JobSpec.model_validate({**base, "rollout": rollout, "resources": resources})
        assert spec.rollout.max_staleness == rollout["max_staleness"]
    with pytest.raises(ValidationError):
        JobSpec.model_validate({**base, "rollout": {"max_staleness": -1}})


def test_stale_batches_get_the_sequence_mask_unless_the_spec_names_one(toy_dir):
    """A job with max_staleness > 0 that names no off_policy_mask trains with STALE_BATCH_MASK, shown in its stored
    spec; an explicit null or mask is kept, and a synchronous job gets none."""
    base = toy_spec(toy_dir)
    stale = JobSpec.model_validate({**base, "rollout": {"max_staleness": 1}, "loss": {"ratio_max": 4.0}})
    assert stale.loss.off_policy_mask == OffPolicyMaskSpec(**STALE_BATCH_MASK) and stale.loss.ratio_max == 4.0
    assert STALE_BATCH_MASK == {"token_bounds": None, "sequence_threshold": 0.03}
    assert JobSpec.model_validate(stale.model_dump(mode="json")) == stale  # what the worker reads back
    assert JobSpec.model_validate(base).loss.off_policy_mask is None
    kept_none = JobSpec.model_validate({**base, "rollout": {"max_staleness": 2}, "loss": {"off_policy_mask": None}})
    assert kept_none.loss.off_policy_mask is None
    band = {"token_bounds": [0.5, 5.0]}
    assert JobSpec.model_validate({**base, "rollout": {"max_staleness": 1}, "loss": {"off_policy_mask": band}}
                                  ).loss.off_policy_mask == OffPolicyMaskSpec(token_bounds=(0.5, 5.0))


def test_a_stale_batch_leaves_out_the_bad_samples_the_last_update_already_pushed_down(toy_dir):
    """The default asynchronous job on a hand-built batch the policy has moved away from (the sampler gave each
    token log-prob 0, the trainer's is below): the negative-advantage sequence adds nothing to the loss, the
    positive one is trained on. Without the mask both were, and the toy task's policy drained into junk."""
    spec = async_spec(toy_dir, 1, mini_batches=1)
    policy = load_policy(spec, resume_from=None, warm_start=None)
    updater = Updater(policy, torch.optim.SGD(policy.trainable_parameters(), lr=0.0), spec)
    prompt, actions = [5, 6, 7], [[8, 9], [10, 11]]
    rollout = Rollout(rows=[{}, {}], token_ids=[prompt + a for a in actions],
                      action_mask=[[0, 0, 0, 1, 1]] * 2, action_turns=[[0, 0]] * 2, prompt_lengths=[3, 3],
                      completions=["", ""], truncated=[False, False], turns=[1, 1],
                      sampler_logprobs=[[0.0, 0.0], [0.0, 0.0]])
    masked = updater.run(rollout, torch.tensor([1.0, -1.0]), [0, 1]).metrics()
    assert masked["off_policy_masked_fraction"] == 0.5
    kept = updater.run(rollout, torch.tensor([1.0, 1.0]), [0, 1]).metrics()
    assert kept["off_policy_masked_fraction"] == 0.0


def test_the_ratio_is_taken_against_the_sampler_logprobs_so_the_cap_binds(toy_dir):
    """A hand-built stale batch: the sampler gave each token log-prob -50, far below the trainer's. Asynchronous,
    every ratio exceeds ratio_max and is clipped; synchronous with one update, the ratio is 1 and nothing is."""
    def clip_fraction(max_staleness: int) -> float:
        spec = async_spec(toy_dir, max_staleness, mini_batches=1)
        policy = load_policy(spec, resume_from=None, warm_start=None)
        updater = Updater(policy, torch.optim.SGD(policy.trainable_parameters(), lr=0.0), spec)
        prompt, actions = [5, 6, 7], [[8, 9], [10, 11]]
        rollout = Rollout(rows=[{}, {}], token_ids=[prompt + a for a in actions],
                          action_mask=[[0, 0, 0, 1, 1]] * 2, action_turns=[[0, 0]] * 2, prompt_lengths=[3, 3],
                          completions=["", ""], truncated=[False, False], turns=[1, 1],
                          sampler_logprobs=[[-50.0, -50.0], [-50.0, -50.0]])
        stats = updater.run(rollout, torch.tensor([1.0, -1.0]), [0, 1])
        return stats.metrics()["clip_fraction"]

    assert clip_fraction(1) == 1.0
    assert clip_fraction(0) == 0.0


# -- the loop ------------------------------------------------------------------------


def test_async_run_trains_within_the_bound_and_stops_its_sampler(toy_dir, tmp_path, sampler_children):
    started, taken = sampler_children
    cb = Recorder()
    result = Trainer(async_spec(toy_dir, 1, "fixed_lag"), tmp_path).run(cb)
    assert result.steps_done == 4 and len(started) == 1
    assert_gone(started[0])
    assert [step for step, _ in taken] == [0, 1, 2, 3]
    for step, versions in taken:  # per sample: the producing version, never more than the bound behind
        assert len(versions) == 16 and all(0 <= step - v <= 1 for v in versions)
    # The batch of step 2 was requested with step 1's and started as soon as it was done: by version 0.
    assert taken[1][1] == [0] * 16
    for m in cb.metrics:
        assert 0 <= m["policy_lag_mean"] <= m["policy_lag_max"] <= 1
        assert m["stale_dropped"] == 0 and m["rollout_wait_s"] >= 0 and m["update_wait_s"] >= 0
    assert cb.metrics[1]["policy_lag_max"] == 1 and cb.metrics[1]["policy_lag_mean"] == 1


def test_synchronous_run_starts_no_sampler_process(toy_dir, tmp_path, sampler_children):
    started, _ = sampler_children
    cb = Recorder()
    Trainer(async_spec(toy_dir, 0, steps=1), tmp_path).run(cb)
    assert started == [] and "policy_lag_max" not in cb.metrics[0]


def test_stop_checkpoints_the_trained_position_and_resume_finishes(toy_dir, tmp_path, sampler_children):
    """Stopped (cancel, pause, drain) after step 2 with steps 3-4 in flight: the sampler is gone, the checkpoint
    holds the data position after step 2 (what was in flight is requested again), and a resumed run finishes."""
    started, taken = sampler_children
    spec = async_spec(toy_dir, 2, "fixed_lag")
    result = Trainer(spec, tmp_path).run(Recorder(stop_at=2))
    assert result.stopped and result.steps_done == 2
    assert_gone(started[0])
    state = load_checkpoint(result.last_checkpoint).state
    assert state["step"] == 2 and state["data"] == {"epoch": 0, "index": 2 * 4}

    resumed = Trainer(spec, tmp_path)
    assert resumed.step == 2
    assert resumed.run(Recorder()).steps_done == 4
    assert_gone(started[1])
    assert [step for step, _ in taken] == [0, 1, 2, 3]
    for step, versions in taken:  # at most 2 versions behind, and the resumed sampler starts at version 2
        assert all(0 <= step - v <= 2 for v in versions)
    assert all(v >= 2 for v in taken[2][1] + taken[3][1])
    assert taken[1][1] == [0] * 16  # requested at the start, with step 1's: sampled before any update


def test_an_exception_in_the_trainer_stops_the_sampler(toy_dir, tmp_path, sampler_children):
    started, _ = sampler_children
    with pytest.raises(RuntimeError, match="callback failure"):
        Trainer(async_spec(toy_dir, 1, steps=2), tmp_path).run(Recorder(raise_at=1))
    assert_gone(started[0])


def test_a_dead_sampler_fails_the_step_with_its_exit_code(toy_dir, tmp_path, sampler_children):
    started, _ = sampler_children

    class KillSampler(Recorder):
        def on_step(self, step, metrics):
            super().on_step(step, metrics)
            if started[0].is_alive():  # once: a batch already scored may still let the next step through
                os.kill(started[0].pid, signal.SIGKILL)
                started[0].join(10)

    with pytest.raises(SamplerDied, match="exited with code -9"):
        Trainer(async_spec(toy_dir, 1, steps=8), tmp_path).run(KillSampler())
    assert_gone(started[0])


# -- through the job runner ----------------------------------------------------------


def sampler_processes() -> list[psutil.Process]:
    """Spawned sampler children (not multiprocessing's resource tracker, which lives as long as this process)."""
    return [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE
            and "spawn_main" in " ".join(p.cmdline())]


def test_paused_async_job_leaves_no_sampler_and_resumes_to_success(postgres_url, toy_dir, tmp_path):
    """Pause at a step boundary under the job runner (lease, fenced writes): the sampler child is gone with the
    run; the resumed run finishes, and the step events carry the lag."""
    from service.db.models import JobEvent
    from service.db.session import session_factory
    from service.repositories import jobs
    from sqlalchemy import select
    from tests.worker.jobs.test_job_runner import job_row, make_settings, run_in_thread, submit, wait_for_step
    from worker.jobs.job_runner import run_job

    settings = make_settings(tmp_path, postgres_url)
    job_id = submit(settings, toy_dir, steps=3, rollout={"max_staleness": 1})
    thread, out = run_in_thread(settings, job_id)
    wait_for_step(settings, job_id, 1, timeout=300)
    assert sampler_processes()  # the run's sampler is up
    with session_factory(settings.resolved_database_url()).begin() as s:
        jobs.request_pause(s, jobs.get_for_worker(s, job_id))
    thread.join(timeout=300)
    assert out["status"] == "paused" and sampler_processes() == []

    with session_factory(settings.resolved_database_url()).begin() as s:
        jobs.resume(s, jobs.get_for_worker(s, job_id))
    assert run_job(job_id, settings) == "succeeded"
    assert job_row(settings, job_id).steps_done == 3 and sampler_processes() == []
    with session_factory(settings.resolved_database_url()).begin() as s:
        messages = [e.message for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id))]
    assert any(m.startswith("Step 3/3:") and "policy_lag_max=" in m for m in messages)
