"""A job's steps read as one run after a run died past its checkpoint: the next lease forgets what the dead run
recorded after it, the re-run's rows replace the dead run's, and trained_tokens counts each step once."""

from __future__ import annotations

from sqlalchemy import select

from service.db.models import Job, JobEvent, JobMetric, JobSample
from service.db.session import session_factory
from service.repositories import job_lease, job_outputs, job_records, jobs
from tests.service.repositories.job_rows import new_job


def _job(database_url: str) -> str:
    return new_job(session_factory(database_url), seed=0, total_steps=5)[1]


def _step(s, job_id: str, epoch: int, step: int, tokens: int, reward: float) -> None:
    assert job_records.record_step(s, job_id, epoch, step, {"reward_mean": reward}, trained_tokens=tokens, ttl_s=60)
    jobs.add_event(s, job_id, f"Step {step}/5", type="metrics", data={"step": step, "reward_mean": reward})
    assert job_outputs.add_samples(s, job_id, epoch, step, [{"prompt": "p", "completion": f"run {reward}",
                                                             "reward": reward, "advantage": 0.0, "rewards": {}}])


def _history(database_url: str, job_id: str):
    with session_factory(database_url).begin() as s:
        job = jobs.get_for_worker(s, job_id)
        metrics = {(m.step, m.name): m.value for m in s.scalars(select(JobMetric).where(JobMetric.job_id == job_id))}
        events = [e.message for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id)
                                               .order_by(JobEvent.seq))]
        samples = {(r.step, r.completion) for r in s.scalars(select(JobSample).where(JobSample.job_id == job_id))}
        return (job.steps_done, job.trained_tokens), metrics, events, samples


def test_a_run_that_died_past_its_checkpoint_is_rewound_and_its_steps_replaced(database_url):
    job_id = _job(database_url)
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        dead = job_lease.claim(s, job_id, "w1", ttl_s=-1)  # its lease has run out: it died
        assert job_records.record_step(s, job_id, dead, 0, {"eval_reward_mean": 0.0}, trained_tokens=0, ttl_s=-1)
        for step in (1, 2):
            _step(s, job_id, dead, step, tokens=10 * step, reward=0.1 * step)
        job_records.add_checkpoint(s, job_id, dead, step=2, storage_prefix="x", files={}, metrics={})
        jobs.add_event(s, job_id, "Checkpoint saved at step 2", data={"step": 2})
        _step(s, job_id, dead, 3, tokens=30, reward=0.3)  # recorded, then the worker died before checkpoint 4
        jobs.add_event(s, job_id, "Reward errors at step 3: ...", level="warn", data={"step": 3})
        s.execute(Job.__table__.update().where(Job.id == job_id).values(lease_expires_at=0))
    assert _history(database_url, job_id)[0] == (3, 60)

    with sessions.begin() as s:
        rerun = job_lease.claim(s, job_id, "w2", ttl_s=60)
    counters, metrics, events, samples = _history(database_url, job_id)
    assert counters == (2, 30)  # as committed at the checkpoint the re-run starts from
    assert {step for step, _ in metrics} == {0, 1, 2} and {step for step, _ in samples} == {1, 2}
    assert events == ["Step 1/5", "Step 2/5", "Checkpoint saved at step 2"]

    with sessions.begin() as s:
        _step(s, job_id, rerun, 3, tokens=31, reward=0.35)
        _step(s, job_id, rerun, 4, tokens=40, reward=0.4)
    counters, metrics, events, samples = _history(database_url, job_id)
    assert counters == (4, 10 + 20 + 31 + 40)
    assert metrics[(3, "reward_mean")] == 0.35 and metrics[(3, "trained_tokens")] == 31
    assert events.count("Step 3/5") == 1 and (3, "run 0.35") in samples and (3, "run 0.3") not in samples


def test_a_repeated_step_in_one_run_replaces_its_values_and_counts_once(database_url):
    job_id = _job(database_url)
    with session_factory(database_url).begin() as s:
        epoch = job_lease.claim(s, job_id, "w", ttl_s=60)
        assert job_records.record_step(s, job_id, epoch, 1, {"loss": 1.0}, trained_tokens=7, ttl_s=60)
        assert job_records.record_step(s, job_id, epoch, 1, {"loss": 2.0}, trained_tokens=9, ttl_s=60)
        assert job_records.record_step(s, job_id, epoch, 1, {"eval_reward_mean": 0.5}, trained_tokens=0, ttl_s=60)
    counters, metrics, _, _ = _history(database_url, job_id)
    assert counters == (1, 9)
    assert metrics == {(1, "loss"): 2.0, (1, "trained_tokens"): 9.0, (1, "eval_reward_mean"): 0.5}


def test_a_run_without_a_checkpoint_starts_the_record_afresh(database_url):
    job_id = _job(database_url)
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        dead = job_lease.claim(s, job_id, "w1", ttl_s=-1)
        assert job_records.record_step(s, job_id, dead, 0, {"eval_reward_mean": 0.0}, trained_tokens=0, ttl_s=-1)
        _step(s, job_id, dead, 1, tokens=10, reward=0.1)
        s.execute(Job.__table__.update().where(Job.id == job_id).values(lease_expires_at=0))
        jobs.add_event(s, job_id, "Job started (attempt 1 of 3) on w1")
    with sessions.begin() as s:
        assert job_lease.claim(s, job_id, "w2", ttl_s=60)
    counters, metrics, events, samples = _history(database_url, job_id)
    assert (counters, metrics, samples) == ((0, 0), {}, set())  # the re-run evaluates step 0 again, too
    assert events == ["Job started (attempt 1 of 3) on w1"]


def test_a_step_re_recorded_counts_against_its_own_jobs_tokens_only(database_url):
    first, second = _job(database_url), _job(database_url)
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        for job_id, tokens in ((first, 100), (second, 7)):
            epoch = job_lease.claim(s, job_id, "w", ttl_s=60)
            assert job_records.record_step(s, job_id, epoch, 1, {}, trained_tokens=tokens, ttl_s=60)
        assert job_records.record_step(s, second, epoch, 1, {}, trained_tokens=9, ttl_s=60)  # the step again
    assert _history(database_url, second)[0] == (1, 9)
    assert _history(database_url, first)[0] == (1, 100)


def test_a_claim_rewinds_its_own_job_only(database_url):
    """Another job's steps past the claimed job's checkpoint, and its tokens, stay as they are."""
    claimed, bystander = _job(database_url), _job(database_url)
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        epoch = job_lease.claim(s, bystander, "w", ttl_s=60)
        for step in (1, 2):
            _step(s, bystander, epoch, step, tokens=10, reward=0.5)
        assert job_records.record_step(s, bystander, epoch, 2, {"loss": 1000.0}, trained_tokens=0, ttl_s=60)
    before = _history(database_url, bystander)
    with sessions.begin() as s:
        dead = job_lease.claim(s, claimed, "w", ttl_s=-1)
        _step(s, claimed, dead, 1, tokens=5, reward=0.1)
        assert job_records.record_step(s, claimed, dead, 1, {"loss": 1000.0}, trained_tokens=0, ttl_s=60)
        job_records.add_checkpoint(s, claimed, dead, step=1, storage_prefix="x", files={}, metrics={})
        _step(s, claimed, dead, 2, tokens=5, reward=0.2)
        s.execute(Job.__table__.update().where(Job.id == claimed).values(lease_expires_at=0))  # then it died
    with sessions.begin() as s:
        assert job_lease.claim(s, claimed, "w2", ttl_s=60)
    assert _history(database_url, bystander) == before and before[0] == (2, 20)
    assert _history(database_url, claimed)[0] == (1, 5)  # the tokens of step 1, not its loss
