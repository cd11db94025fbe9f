"""Worker scratch space: a run removes its own directory however it ends, and the sweep removes what a killed
run left, but never the directory of a run that holds its job's lease."""

from __future__ import annotations

from service.db.session import session_factory
from service.repositories import job_lease, jobs
from tests.worker.jobs.test_job_runner import job_row, make_settings, run_in_thread, submit, wait_for_step
from worker import scratch


def _scratch(settings) -> list[str]:
    root = settings.resolved_work_dir()
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir()) if root.is_dir() else []


def test_a_paused_then_cancelled_job_leaves_no_scratch(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=50, checkpoint_interval=0)
    thread, out = run_in_thread(settings, job_id)
    wait_for_step(settings, job_id, 1)
    assert _scratch(settings)[:2] == [job_id, f"{job_id}/epoch-000001"]  # where the run works
    with session_factory(database_url).begin() as s:
        jobs.request_pause(s, jobs.get_for_worker(s, job_id))
    thread.join(120)
    assert out["status"] == "paused"
    assert _scratch(settings) == []  # the committed checkpoint is all a resumed run needs
    with session_factory(database_url).begin() as s:
        jobs.request_cancel(s, jobs.get_for_worker(s, job_id))
    assert job_row(settings, job_id).status == "cancelled" and _scratch(settings) == []


def test_the_sweep_keeps_only_the_runs_that_hold_their_lease(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url)
    running, finished, queued = (submit(settings, toy_dir, steps=1) for _ in range(3))
    with session_factory(database_url).begin() as s:
        job_lease.claim(s, running, "w1", ttl_s=-1)  # a run that died (its lease ran out) ...
        live = job_lease.claim(s, running, "w2", ttl_s=60)  # ... and the one that took over
        epoch = job_lease.claim(s, finished, "w", ttl_s=60)
        assert job_lease.finish(s, finished, epoch, "cancelled")
    dirs = [scratch.run_dir(settings, running, live - 1), scratch.run_dir(settings, running, live),
            scratch.run_dir(settings, finished, 1), scratch.run_dir(settings, queued, 1),  # drained or paused
            scratch.run_dir(settings, "ftjob-gone", 3), settings.resolved_work_dir() / "ftjob-empty"]
    for d in dirs:
        (d / "data").mkdir(parents=True)
    removed = scratch.sweep(settings)
    assert _scratch(settings) == [running, f"{running}/epoch-{live:06d}", f"{running}/epoch-{live:06d}/data"]
    assert sorted(removed) == sorted([*dirs[:1], *dirs[2:5], dirs[5] / "data"])
    assert scratch.sweep(settings) == []  # nothing twice


def test_a_finished_job_keeps_only_its_committed_checkpoints_in_the_store(database_url, toy_dir, tmp_path):
    from service.storage import open_store
    from worker.jobs.job_runner import run_job

    settings = make_settings(tmp_path, database_url)
    job_id = submit(settings, toy_dir, steps=2)
    store = open_store(settings.resolved_storage_url())
    orphan = f"jobs/{job_id}/checkpoints/epoch-000009/step-000002"  # a dead run's upload, never committed
    store.put_bytes(f"{orphan}/adapter.tar", b"half")
    assert run_job(job_id, settings) == "succeeded"
    with session_factory(database_url).begin() as s:
        committed = {c.storage_prefix for c in jobs.checkpoints(s, job_id, after=None, limit=100).items}
    stored = {"/".join(k.split("/")[:5]) for k in store.list(f"jobs/{job_id}/checkpoints")}
    assert committed and stored == committed
    assert not (store.root / "jobs" / job_id / "checkpoints" / "epoch-000009").exists()
