"""Faults the production stack meets, injected for real: a forked worker child, a stalled Redis,
an object store that goes away mid-job, a worker frozen (SIGSTOP) past its lease."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import pytest
from sqlalchemy import select, text

from service.db.models import Checkpoint
from service.db.session import session_factory
from service.queue import enqueue_job, make_celery
from service.settings import Settings
from service.storage import open_store
from tests.conftest import REDIS_TEST_URL
from tests.tcp_proxy import TcpProxy
from tests.worker.jobs.test_job_runner import job_row, submit
from worker.jobs.job_runner import run_job


def _backend_pid_in_child(url: str, out) -> None:
    with session_factory(url).begin() as s:
        out.put(s.scalar(text("SELECT pg_backend_pid()")))


def test_a_forked_child_never_reuses_the_parents_database_connection(postgres_url):
    # The reconciler runs in the Celery parent; prefork children used its pooled connection.
    with session_factory(postgres_url).begin() as s:
        parent = s.scalar(text("SELECT pg_backend_pid()"))
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_backend_pid_in_child, args=(postgres_url, out))
    child.start()
    child_pid = out.get(timeout=30)
    child.join(30)
    assert child.exitcode == 0
    assert child_pid != parent  # its own server session, not the parent's socket
    with session_factory(postgres_url).begin() as s:  # and the parent's connection still works
        assert s.scalar(text("SELECT pg_backend_pid()")) == parent


def test_a_stalled_broker_fails_sends_and_pings_quickly():
    host, port = "127.0.0.1", int(urlsplit(REDIS_TEST_URL).port)
    with TcpProxy(host, port) as proxy:
        settings = Settings(broker_url=f"redis://127.0.0.1:{proxy.port}/{REDIS_TEST_URL.rsplit('/', 1)[1]}",
                            broker_timeout_s=1)
        enqueue_job("ftjob-healthy", settings=settings)  # through the proxy, while Redis answers
        proxy.stall()  # accepts, never answers: without socket timeouts both calls below hang forever
        for attempt in (lambda: enqueue_job("ftjob-stalled", settings=settings),
                        lambda: make_celery(settings).connection_for_write().ensure_connection(max_retries=1,
                                                                                             timeout=1)):
            outcome = []

            def call(attempt=attempt):
                try:
                    attempt()
                    outcome.append("returned")
                except Exception as e:
                    outcome.append(e)

            caller = threading.Thread(target=call, daemon=True)  # a hang must fail the test, not block it
            caller.start()
            caller.join(10)
            assert outcome and isinstance(outcome[0], Exception), f"still waiting on the broker: {outcome}"
        proxy.unstall()


def _s3_settings(tmp_path, database_url, s3_url, **kw) -> Settings:
    return Settings(home=tmp_path / "home", database_url=database_url, storage_url=s3_url,
                    heartbeat_s=0.2, lease_ttl_s=30, retry_backoff_s=0, **kw)


def _through(proxy: TcpProxy, s3_url: str) -> str:
    return s3_url.replace(f"endpoint_url=http://127.0.0.1:{proxy.target_port}",
                          f"endpoint_url=http://127.0.0.1:{proxy.port}")


def _wait_for_checkpoint(settings, job_id, step, timeout=120):
    deadline = time.time() + timeout
    while True:
        with session_factory(settings.resolved_database_url()).begin() as s:
            if s.scalar(select(Checkpoint.id).where(Checkpoint.job_id == job_id, Checkpoint.step == step)):
                return
        assert time.time() < deadline, f"no checkpoint at step {step}"
        time.sleep(0.05)


@pytest.mark.slow
def test_an_object_store_outage_retries_the_job_from_its_last_checkpoint(postgres_url, s3_url, moto_endpoint,
                                                                        toy_dir, tmp_path):
    port = int(urlsplit(moto_endpoint).port)
    proxy = TcpProxy("127.0.0.1", port).start()
    try:
        # One attempt only: an outage must not spend it (it is no fault of the job's).
        settings = _s3_settings(tmp_path, postgres_url, _through(proxy, s3_url), max_attempts=1)
        job_id = submit(settings, toy_dir, steps=4)
        out = {}
        worker = threading.Thread(target=lambda: out.setdefault("status", run_job(job_id, settings)))
        worker.start()
        _wait_for_checkpoint(settings, job_id, 2)
        proxy.kill()  # the store goes away: the step-4 upload fails (after the client's own retries)
        worker.join(180)
        assert out["status"] == "queued"  # not failed: the run is tried again
        job = job_row(settings, job_id)
        assert (job.status, job.attempts, job.error_code) == ("queued", 0, None) and job.outage_since

        proxy = TcpProxy("127.0.0.1", port, port=proxy.port).start()  # the store is back
        _wait_out_backoff(settings, job_id)
        assert run_job(job_id, settings) == "succeeded"
        job = job_row(settings, job_id)
        assert (job.status, job.attempts, job.steps_done, job.outage_since) == ("succeeded", 1, 4, None)
        from service.db.models import JobEvent

        with session_factory(postgres_url).begin() as s:
            messages = [e.message for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id))]
        assert any(m.startswith("The object store is unavailable") and "using no attempt" in m for m in messages)
        assert "Resumed from the checkpoint at step 2" in messages
    finally:
        proxy.kill()


def _wait_out_backoff(settings, job_id) -> None:
    time.sleep(max(0.0, (job_row(settings, job_id).not_before or 0) - time.time()) + 0.05)


@pytest.mark.slow
def test_an_object_store_outage_spends_no_attempt_until_its_deadline(postgres_url, s3_url, moto_endpoint, toy_dir,
                                                                     tmp_path):
    from service.db.models import Job

    proxy = TcpProxy("127.0.0.1", int(urlsplit(moto_endpoint).port)).start()
    try:
        settings = _s3_settings(tmp_path, postgres_url, _through(proxy, s3_url), max_attempts=1,
                                outage_deadline_s=600)
        job_id = submit(settings, toy_dir, steps=2)
        proxy.kill()  # down before the job starts: its dataset cannot be fetched
        for run in range(3):
            assert run_job(job_id, settings) == "queued"
            job = job_row(settings, job_id)
            assert (job.status, job.attempts, job.error_code) == ("queued", 0, None)
            since = job.outage_since if run == 0 else since
            assert job.outage_since == since  # one outage, from its first sighting
            _wait_out_backoff(settings, job_id)

        with session_factory(postgres_url).begin() as s:  # the outage outlasts the deadline
            s.execute(Job.__table__.update().where(Job.id == job_id).values(outage_since=since - 600))
        assert run_job(job_id, settings) == "failed"  # now a failed run counts, and this was the only one
        job = job_row(settings, job_id)
        assert (job.attempts, job.error_code) == (1, "storage_unavailable")
    finally:
        proxy.kill()


_RUN_ONE_JOB = ("import sys; from service.settings import Settings; from worker.jobs.job_runner import run_job; "
                "print('run ended:', run_job(sys.argv[1], Settings()), flush=True)")


def _stored_versions(settings: Settings, job_id: str) -> dict[str, tuple]:
    """(LastModified, ETag) of every object a committed checkpoint points at."""
    store = open_store(settings.resolved_storage_url())
    with session_factory(settings.resolved_database_url()).begin() as s:
        ckpts = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)))
    versions = {}
    for c in ckpts:
        for rel in c.files:
            head = store.client.head_object(Bucket=store.bucket, Key=store._key(f"{c.storage_prefix}/{rel}"))
            versions[f"{c.storage_prefix}/{rel}"] = (head["LastModified"], head["ETag"])
    return versions


@pytest.mark.slow
def test_a_worker_frozen_past_its_lease_never_overwrites_a_committed_checkpoint(postgres_url, s3_url, moto_endpoint,
                                                                                toy_dir, tmp_path):
    from tests.worker.jobs.test_job_runner import wait_for_step

    with TcpProxy("127.0.0.1", int(urlsplit(moto_endpoint).port)) as proxy:
        settings = Settings(home=tmp_path / "b", database_url=postgres_url, storage_url=s3_url,
                            heartbeat_s=0.5, lease_ttl_s=6, retry_backoff_s=0)
        job_id = submit(settings, toy_dir, steps=4)  # checkpoints at steps 2 and 4
        env = {**os.environ, "DATABASE_URL": postgres_url, "STORAGE_URL": _through(proxy, s3_url),
               "CISPO_HOME": str(tmp_path / "a"), "CISPO_HEARTBEAT_S": "0.5", "CISPO_LEASE_TTL_S": "6"}
        stale = subprocess.Popen([sys.executable, "-c", _RUN_ONE_JOB, job_id], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            wait_for_step(settings, job_id, 1, timeout=300)
            proxy.stall()  # the store hangs for this worker: its step-2 checkpoint upload blocks
            wait_for_step(settings, job_id, 2)
            time.sleep(1.0)
            os.kill(stale.pid, signal.SIGSTOP)  # frozen mid-upload: no heartbeat, the lease runs out
            time.sleep(settings.lease_ttl_s + 1)

            assert run_job(job_id, settings) == "succeeded"  # a healthy worker takes over and finishes
            committed = _stored_versions(settings, job_id)
            assert len(committed) > 4

            os.kill(stale.pid, signal.SIGCONT)  # the stale worker wakes up and its upload goes through
            proxy.unstall()
            out, _ = stale.communicate(timeout=180)
            assert "run ended: None" in out, out[-3000:]  # it found its lease gone and stopped
            assert not (tmp_path / "a" / "work" / job_id).exists()  # and left no scratch behind
            assert _stored_versions(settings, job_id) == committed  # not one committed object rewritten
            assert job_row(settings, job_id).status == "succeeded"
        finally:
            if stale.poll() is None:
                os.kill(stale.pid, signal.SIGCONT)
                stale.kill()


# A worker that dies right after recording a step past its newest checkpoint (the step is in SQL, the
# checkpoint that would cover it never is): a crash, an OOM kill, a lost lease.
_DIE_AFTER_STEP = """
import os, signal, sys
from service.settings import Settings
from worker.jobs import job_runner

record = job_runner.JobReporter.on_step

def on_step(self, step, metrics):
    record(self, step, metrics)
    if step == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)

job_runner.JobReporter.on_step = on_step
job_runner.run_job(sys.argv[1], Settings())
"""

_TIMINGS = ("seconds", "per_second")  # wall-clock metrics differ between any two runs


def _record(settings, job_id):
    from service.db.models import JobEvent, JobMetric

    with session_factory(settings.resolved_database_url()).begin() as s:
        metrics = {(m.step, m.name): m.value for m in s.scalars(select(JobMetric).where(JobMetric.job_id == job_id))}
        steps = [e for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "metrics")
                                      .order_by(JobEvent.seq)) if e.message.startswith("Step ")]
        return metrics, [(e.data["step"], e.data) for e in steps]


@pytest.mark.slow
def test_a_run_killed_past_its_checkpoint_reads_as_one_run_once_resumed(postgres_url, toy_dir, tmp_path):
    database_url = postgres_url
    reference = Settings(home=tmp_path / "ref", database_url=database_url, storage_url=str(tmp_path / "objects"),
                         heartbeat_s=0.2, lease_ttl_s=30, retry_backoff_s=0)
    ref_id = submit(reference, toy_dir, steps=5)  # checkpoints at steps 2, 4 and 5
    assert run_job(ref_id, reference) == "succeeded"

    settings = reference.model_copy(update={"home": tmp_path / "survivor"})
    job_id = submit(settings, toy_dir, steps=5)
    env = {**os.environ, "DATABASE_URL": database_url, "STORAGE_URL": str(tmp_path / "objects"),
           "CISPO_HOME": str(tmp_path / "dead"), "CISPO_HEARTBEAT_S": "0.2", "CISPO_LEASE_TTL_S": "2"}
    dead = subprocess.run([sys.executable, "-c", _DIE_AFTER_STEP, job_id, "3"], env=env, timeout=300,
                          capture_output=True, text=True)
    assert dead.returncode == -signal.SIGKILL, dead.stdout[-2000:] + dead.stderr[-2000:]
    assert job_row(settings, job_id).steps_done == 3  # step 3 was recorded; the checkpoint is at step 2
    time.sleep(2.5)  # its lease runs out

    assert run_job(job_id, settings) == "succeeded"
    job, ref = job_row(settings, job_id), job_row(reference, ref_id)
    assert (job.attempts, job.steps_done, job.trained_tokens) == (2, 5, ref.trained_tokens)
    metrics, step_events = _record(settings, job_id)
    ref_metrics, _ = _record(reference, ref_id)
    assert [step for step, _ in step_events] == [1, 2, 3, 4, 5]  # one step event per step
    for step, data in step_events:  # the metrics rows are those of the run the events show
        assert {k: v for (s_, k), v in metrics.items() if s_ == step and not k.startswith("eval_")} == \
            {k: v for k, v in data.items() if k not in ("step", "total_steps")}
    assert metrics.keys() == ref_metrics.keys()
    same = {key: v for key, v in metrics.items() if not key[1].endswith(_TIMINGS)}
    assert same == pytest.approx({key: v for key, v in ref_metrics.items() if not key[1].endswith(_TIMINGS)})
