"""The worker's job runner against a real database and object store, without Celery.

These pin the lease, the fenced writes, cancellation and pause at a step
boundary, and that a paused-then-resumed job ends with exactly the adapter
an uninterrupted job produces.
"""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import select, update

from service.db.models import Checkpoint, Job, JobEvent, JobMetric
from service.db.session import session_factory
from service.repositories import job_lease, job_records, jobs, projects
from service.job_spec.spec import JobSpec
from service.settings import Settings
from service.storage import open_store
from service.storage_layout import checkpoint_prefix
from worker.jobs.job_runner import run_job
from worker.toy.__main__ import toy_spec


def make_settings(tmp_path, database_url) -> Settings:
    return Settings(home=tmp_path / "home", database_url=database_url, storage_url=str(tmp_path / "objects"),
                    heartbeat_s=0.2, lease_ttl_s=30, retry_backoff_s=0)


def submit(settings: Settings, toy_dir, *, reward: dict | None = None, resources: dict | None = None,
           rollout: dict | None = None, **training) -> str:
    """A queued job on the toy task, its dataset already uploaded, as the API would leave it."""
    store = open_store(settings.resolved_storage_url())
    store.put_file("files/file-train", toy_dir / "train.jsonl")
    store.put_file("files/file-val", toy_dir / "val.jsonl")
    raw = toy_spec(toy_dir)
    if reward is not None:
        raw["reward"] = reward
    raw["data"] = {"train_file": "file-train", "validation_file": "file-val"}
    if resources is not None:
        raw["resources"] = resources
    if rollout is not None:
        raw["rollout"] = rollout
    raw["training"].update({"batch_size": 4, "group_size": 4, "micro_batch_size": 16, "mini_batches": 2,
                            "eval_interval": 0, "eval_max_rows": 8, "checkpoint_interval": 2, **training})
    spec = JobSpec.model_validate(raw)
    with session_factory(settings.resolved_database_url()).begin() as s:
        project = projects.get_or_create_project(s, "p")
        job = jobs.add(s, Job(project_id=project.id, status="queued", model=spec.model, training_file="file-train",
                              validation_file="file-val", spec=spec.model_dump(mode="json"), method={"type": "cispo"},
                              seed=spec.seed, total_steps=spec.training.steps))
        return job.id


def job_row(settings, job_id) -> Job:
    with session_factory(settings.resolved_database_url()).begin() as s:
        return jobs.get_for_worker(s, job_id)


def run_in_thread(settings, job_id):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("status", run_job(job_id, settings)))
    t.start()
    return t, out


def wait_for_step(settings, job_id, step, timeout=120):
    deadline = time.time() + timeout
    while job_row(settings, job_id).steps_done < step:
        assert time.time() < deadline, "the job made no progress"
        time.sleep(0.05)


def test_job_runs_to_success_and_records_everything(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=3)
    assert run_job(job_id, settings) == "succeeded"

    job = job_row(settings, job_id)
    assert (job.status, job.steps_done, job.attempts, job.lease_owner) == ("succeeded", 3, 1, None)
    assert job.finished_at and job.trained_tokens > 0
    with session_factory(settings.resolved_database_url()).begin() as s:
        steps = sorted(s.scalars(select(JobMetric.step).where(JobMetric.name == "reward_mean")))
        assert steps == [1, 2, 3]
        # The step-0 baseline, the scheduled checkpoint at step 2 and the last step (eval_interval 0).
        eval_steps = sorted(s.scalars(select(JobMetric.step).where(JobMetric.name == "eval_reward_mean")))
        assert eval_steps == [0, 2, 3]
        messages = [e.message for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq))]
        ckpts = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)))
    assert messages[0].startswith("Job started") and messages[-1].startswith("Job succeeded; reward ")
    assert any(m.startswith("Step 3/3:") for m in messages)
    # what the worker does before step 1 is shown, in order
    starting = ["Fetching the dataset", f"Loading the model {toy_dir / 'model'}", "Starting the rollout engine (hf)"]
    assert [m for m in messages if m in starting] == starting
    assert messages.index(starting[-1]) < next(i for i, m in enumerate(messages) if m.startswith("Step 1/3"))
    assert [c.step for c in ckpts] == [2, 3]
    store = open_store(settings.resolved_storage_url())
    for c in ckpts:
        assert {"adapter.tar", "manifest.json", "adapter/adapter_model.safetensors"} <= c.files.keys()
        for rel, meta in c.files.items():
            data = b"".join(store.iter_bytes(f"{c.storage_prefix}/{rel}"))
            import hashlib

            assert hashlib.sha256(data).hexdigest() == meta["sha256"], rel
    assert not (settings.resolved_work_dir() / job_id).exists()  # scratch space is cleaned up

    # a duplicate broker message for a finished job changes nothing
    assert run_job(job_id, settings) is None
    assert job_row(settings, job_id).attempts == 1


def test_cancel_is_honoured_within_one_step(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=500, checkpoint_interval=0)
    thread, out = run_in_thread(settings, job_id)
    wait_for_step(settings, job_id, 1)
    with session_factory(settings.resolved_database_url()).begin() as s:
        jobs.request_cancel(s, jobs.get_for_worker(s, job_id))
        requested_at = jobs.get_for_worker(s, job_id).steps_done
    thread.join(timeout=120)
    assert out["status"] == "cancelled"
    job = job_row(settings, job_id)
    assert job.status == "cancelled" and job.steps_done <= requested_at + 2 < 500


def test_paused_job_resumes_to_the_same_adapter(database_url, toy_dir, tmp_path):
    reference = make_settings(tmp_path / "a", database_url)
    ref_id = submit(reference, toy_dir, steps=6)
    assert run_job(ref_id, reference) == "succeeded"

    settings = make_settings(tmp_path / "b", database_url)
    job_id = submit(settings, toy_dir, steps=6)
    thread, out = run_in_thread(settings, job_id)
    wait_for_step(settings, job_id, 1)
    with session_factory(settings.resolved_database_url()).begin() as s:
        jobs.request_pause(s, jobs.get_for_worker(s, job_id))
    thread.join(timeout=120)
    assert out["status"] == "paused"
    paused = job_row(settings, job_id)
    assert paused.status == "paused" and 1 <= paused.steps_done < 6

    with session_factory(settings.resolved_database_url()).begin() as s:
        jobs.resume(s, jobs.get_for_worker(s, job_id))
    # resume on a "different machine": the local scratch space is gone
    import shutil

    shutil.rmtree(settings.resolved_work_dir(), ignore_errors=True)
    assert run_job(job_id, settings) == "succeeded"
    with session_factory(database_url).begin() as s:
        # The adapter's bytes (the tar also holds the trainer state, whose spec names each run's local paths).
        final = {j: jobs.latest_checkpoint(s, j).files["adapter/adapter_model.safetensors"]["sha256"]
                 for j in (ref_id, job_id)}
        resumed_events = [e.message for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id))]
        steps = list(s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id, JobMetric.name == "reward_mean")
                               .order_by(JobMetric.step)))
    assert final[ref_id] == final[job_id]
    assert any(m.startswith("Resumed from the checkpoint at step") for m in resumed_events)
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_worker_that_lost_its_lease_cannot_write(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=3)
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        first = job_lease.claim(s, job_id, "w1", ttl_s=-1)  # expires at once
    with sessions.begin() as s:
        second = job_lease.claim(s, job_id, "w2", ttl_s=30)  # takes over the expired lease
    assert second == first + 1
    with sessions.begin() as s:
        assert not job_records.record_step(s, job_id, first, 1, {"loss": 1.0}, trained_tokens=0, ttl_s=30)
        assert job_lease.heartbeat(s, job_id, first, 30) is None
        assert not job_lease.finish(s, job_id, first, "succeeded")
        assert job_records.record_step(s, job_id, second, 1, {"loss": 1.0}, trained_tokens=0, ttl_s=30)
        # a repeat replaces the step's values
        assert job_records.record_step(s, job_id, second, 1, {"loss": 2.0}, trained_tokens=0, ttl_s=30)
    with sessions.begin() as s:
        assert s.scalar(select(JobMetric.value).where(JobMetric.job_id == job_id)) == 2.0
        assert jobs.get_for_worker(s, job_id).status == "running"



def test_a_run_that_fails_after_losing_its_lease_leaves_the_job_to_its_new_owner(database_url, toy_dir, tmp_path,
                                                                                  monkeypatch):
    """A run whose lease was taken over and that then fails writes nothing, and keeps its hands off the new
    owner's uploads that are not committed yet: the failure is no longer its job's."""
    from worker.jobs import job_runner

    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=3)
    sessions, store = session_factory(database_url), open_store(settings.resolved_storage_url())
    upload = f"{checkpoint_prefix(job_id, 2, 'step-00000002')}/adapter.tar"

    def taken_over_then_failing(claimed, store_, work, settings_, reporter):
        with sessions.begin() as s:  # the lease lapses and another worker claims the job
            s.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=time.time() - 1))
            assert job_lease.claim(s, job_id, "w2", ttl_s=30) == claimed.epoch + 1
        store.put_bytes(upload, b"w2's checkpoint, uploaded, not yet committed")
        deadline = time.time() + 30
        while not reporter.lost:  # the run's heartbeat sees its renewal refused
            assert time.time() < deadline, "the run never saw its lease lost"
            time.sleep(0.05)
        raise ValueError("a row of the dataset is bad")  # a failure that would end the job at once

    monkeypatch.setattr(job_runner, "train", taken_over_then_failing)
    assert run_job(job_id, settings) is None
    job = job_row(settings, job_id)
    assert (job.status, job.lease_owner, job.lease_epoch, job.error_code) == ("running", "w2", 2, None)
    assert upload in store.list(f"jobs/{job_id}")  # w2 commits it later
    assert not any(e.message.startswith("Job failed") for e in _events(database_url, job_id))

def test_reconciler_requeues_a_job_whose_worker_died(database_url, toy_dir, tmp_path, monkeypatch):
    from worker.jobs import reconciler

    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=2)
    with session_factory(database_url).begin() as s:
        job_lease.claim(s, job_id, "dead-worker", ttl_s=-1)
    sent = []
    monkeypatch.setattr(reconciler, "enqueue_job", lambda job_id, delay_s=0.0, settings=None: sent.append(job_id))
    assert reconciler.reconcile_once(settings) == [job_id]
    assert sent == [job_id] and job_row(settings, job_id).status == "queued"
    assert reconciler.reconcile_once(settings) == []  # nothing twice
    assert run_job(job_id, settings) == "succeeded"
    assert job_row(settings, job_id).attempts == 2


def test_reconciler_resends_a_job_whose_message_was_lost(database_url, toy_dir, tmp_path, monkeypatch):
    from worker.jobs import reconciler

    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=1)
    sent = []
    monkeypatch.setattr(reconciler, "enqueue_job", lambda job_id, delay_s=0.0, settings=None: sent.append(job_id))
    memory: dict[str, float] = {}
    assert reconciler.reconcile_once(settings, resend_after_s=3600, sent=memory) == []  # too young to worry
    assert reconciler.reconcile_once(settings, resend_after_s=-1, sent=memory) == [job_id]
    assert sent == [job_id]


# -- reward errors and secrets -------------------------------------------------------


def _events(database_url, job_id) -> list[JobEvent]:
    with session_factory(database_url).begin() as s:
        rows = list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)))
        s.expunge_all()
        return rows


def test_reward_errors_become_warn_events(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=2,
                    reward={"type": "import", "path": "tests.worker.trainer.test_reward_errors:fails_on_answer_a"})
    assert run_job(job_id, settings) == "succeeded"
    warns = [e for e in _events(database_url, job_id) if e.level == "warn"]
    assert warns, "the toy data has answers 'a' in most batches"
    for e in warns:
        assert e.message.startswith(f"Reward errors at step {e.data['step']}: ")
        assert "ValueError: no reward for a (x" in e.message
        assert e.data["errors"] == [{"message": "ValueError: no reward for a", "count": e.data["reward_errors"]}]


def test_a_broken_reward_fails_the_job_with_reward_error_rate(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=3,
                    reward={"type": "import", "path": "tests.worker.trainer.test_reward_errors:always_fails"})
    assert run_job(job_id, settings) == "failed"
    job = job_row(settings, job_id)
    assert job.error_code == "reward_error_rate" and job.steps_done == 0
    assert job.error_message == ("reward function failed on 100% of samples at step 1 (threshold 50%; 16 of 16): "
                                 "ZeroDivisionError: division by zero")
    events = _events(database_url, job_id)
    warn = next(e for e in events if e.level == "warn" and "errors" in (e.data or {}))  # not the pre-flight's
    assert warn.data["errors"] == [{"message": "ZeroDivisionError: division by zero", "count": 16}]
    assert events[-1].level == "error" and events[-1].message.startswith("Job failed: reward function failed on 100%")


def test_the_worker_resolves_the_secret_and_never_records_it(database_url, toy_dir, tmp_path):
    from service.db.models import Secret
    from service.secrets.box import secret_box
    from tests.worker.rewards.reward_servers import reward_server

    settings = make_settings(tmp_path, database_url).model_copy(update={"egress_allow": "127.0.0.1"})
    with reward_server() as (base, rec):
        job_id = submit(settings, toy_dir, steps=1,
                        reward={"type": "http", "url": f"{base}/good", "auth_secret": "grader", "batch_size": 64})
        with session_factory(database_url).begin() as s:
            project_id = jobs.get_for_worker(s, job_id).project_id
            s.add(Secret(project_id=project_id, name="grader", ciphertext=secret_box(settings).seal(
                "Bearer sk-very-secret"), hosts=["127.0.0.1"]))
        assert run_job(job_id, settings) == "succeeded"
    assert rec.requests and {r["headers"]["Authorization"] for r in rec.requests} == {"Bearer sk-very-secret"}
    job = job_row(settings, job_id)
    recorded = str(job.spec) + "".join(f"{e.message}{e.data}" for e in _events(database_url, job_id))
    assert "grader" in str(job.spec) and "sk-very-secret" not in recorded


def test_a_missing_secret_fails_the_job_by_name(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=1,
                    reward={"type": "http", "url": "https://example.com/score", "auth_secret": "gone"})
    assert run_job(job_id, settings) == "failed"
    job = job_row(settings, job_id)
    assert job.error_code == "invalid_job" and "needs the secret 'gone'" in job.error_message


def test_a_job_asking_more_gpus_than_the_worker_sees_fails_at_once_naming_the_field(database_url, toy_dir, tmp_path,
                                                                                     monkeypatch):
    """resources.gpus 2 on a worker that sees one CUDA device: refused before torchrun starts, and not retried."""
    import worker.torchrun.launch as launch

    monkeypatch.setattr(launch, "visible_gpus", lambda: 1)  # the hardware, injected
    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=1, resources={"gpus": 2})
    assert run_job(job_id, settings) == "failed"
    job = job_row(settings, job_id)
    assert (job.status, job.attempts, job.error_code) == ("failed", 1, "invalid_job")
    assert "resources.gpus is 2, but this worker sees 1 CUDA device" in job.error_message
    assert not (settings.resolved_work_dir() / job_id / "run" / "ranks.log").exists()  # no rank was started


def test_repeated_reward_errors_are_throttled_but_new_ones_are_shown(tmp_path):
    from worker.jobs.job_reporter import REWARD_WARN_EVERY, JobReporter

    reporter = JobReporter(None, None, "ftjob-x", 1, Settings(home=tmp_path), total_steps=100)
    shown = []
    reporter.event = lambda message, **kw: shown.append((kw["data"]["step"], message))
    long_message = "ValueError: " + "x" * 500
    for step in range(1, 26):
        reporter.on_reward_errors(step, ["KeyError: 'a'"] * 3 + ([long_message] if step == 5 else []))
    assert [s for s, _ in shown] == [1, 5, 5 + REWARD_WARN_EVERY, 5 + 2 * REWARD_WARN_EVERY]
    first, fifth = shown[0][1], shown[1][1]
    assert first == "Reward errors at step 1: 3 samples failed to score: KeyError: 'a' (x3)"
    assert "(x1)" in fifth and len(fifth) < 400  # each message is truncated
    reporter.on_reward_errors(26, [f"E{i}: boom" for i in range(8)])
    assert shown[-1][1].endswith("; and 3 other distinct errors")


ALWAYS_ZERO = {"type": "import", "path": "tests.worker.trainer.test_learning_signal:always_zero"}


def test_a_job_that_cannot_learn_says_so_in_its_events(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=2, reward=ALWAYS_ZERO, no_signal_steps=2)
    assert run_job(job_id, settings) == "succeeded"
    events = _events(database_url, job_id)
    preflight = next(e for e in events if e.message.startswith("Pre-flight:"))
    assert preflight.level == "warn" and "100% of groups have zero reward variance" in preflight.message
    assert preflight.data["preflight_reward_mean"] == 0.0 and preflight.data["preflight_groups"] == 2
    assert preflight.seq < next(e.seq for e in events if e.message.startswith("Step 1/2"))
    warn = next(e for e in events if e.message.startswith("No learning signal"))
    assert warn.level == "warn" and warn.data == {"step": 2, "zero_variance_steps": 2}
    assert events[-1].message.startswith("Job succeeded; reward did not move beyond noise: 0.0000")
    assert events[-1].data["reward_moved"] is False
    with session_factory(database_url).begin() as s:
        names = set(s.scalars(select(JobMetric.name).where(JobMetric.job_id == job_id, JobMetric.step == 0)))
    assert {"preflight_reward_mean", "preflight_zero_variance_fraction"} <= names


def test_fail_on_no_signal_fails_at_once_with_no_learning_signal(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=3, reward=ALWAYS_ZERO, fail_on_no_signal=True)
    assert run_job(job_id, settings) == "failed"  # not queued again: the next attempt would find the same
    job = job_row(settings, job_id)
    assert (job.error_code, job.attempts, job.steps_done) == ("no_learning_signal", 1, 0)
    assert "all 2 pre-flight groups got one reward" in job.error_message


def test_an_engine_that_cannot_run_the_model_fails_without_a_retry(database_url, toy_dir, tmp_path):
    """The toy model's head size 16 on a CPU worker: refused before vLLM starts, and not retried."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA takes head size 16")
    pytest.importorskip("vllm")
    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=2)
    with session_factory(settings.resolved_database_url()).begin() as s:
        job = jobs.get_for_worker(s, job_id)
        job.spec = {**job.spec, "rollout": {**job.spec["rollout"], "engine": "vllm"}}
    assert run_job(job_id, settings) == "failed"
    job = job_row(settings, job_id)
    assert (job.error_code, job.attempts) == ("engine_unsupported", 1)
    assert "vLLM on CPU cannot run attention head size 16" in job.error_message
