"""The worker's scratch roots and the serving channel's file are the owner's only, also where CISPO_WORK_DIR lies
outside the private home: they hold every tenant's datasets, weights, prompts and answers."""

from __future__ import annotations

import os
import stat

from service.serving.channel import SqliteChannel
from service.settings import Settings
from worker import scratch
from worker.jobs import eval_runner
from worker.serving.server import ServingWorker


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_scratch_roots_are_0700_and_the_serving_channel_0600(tmp_path):
    old = os.umask(0o022)  # the usual umask: what mkdir made 0755 and sqlite 0644
    try:
        settings = Settings(home=tmp_path / "home", work_dir=tmp_path / "shared" / "work",
                            storage_url=str(tmp_path / "objects"))
        (tmp_path / "shared" / "eval-work").mkdir(parents=True, mode=0o755)  # left wide by an older version
        run = scratch.make_run_dir(scratch.run_dir(settings, "ftjob-x", 1))
        evals = eval_runner.work_dir(settings, "eval-x")
        channel = SqliteChannel(tmp_path / "shared" / "serve.db")
        channel.push("k", {"prompt": "secret"}, ttl_s=60)
        worker = ServingWorker(settings, [], channel=channel)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "shared" / "work") == 0o700 and run.is_relative_to(tmp_path / "shared" / "work")
    assert _mode(tmp_path / "shared" / "eval-work") == 0o700 and evals.parent == tmp_path / "shared" / "eval-work"
    assert worker.scratch == tmp_path / "shared" / "serve-work" and _mode(worker.scratch) == 0o700
    assert _mode(tmp_path / "shared" / "serve.db") == 0o600


def test_the_jobs_sweep_leaves_the_other_workers_scratch_alone(tmp_path, database_url):
    """The sweep removes what no job lease holds under the jobs' work directory; the Tinker and serving workers'
    saved states and adapters on their way in or out are no job's, so they live beside it."""
    from worker.tinker.runner import TinkerRunner

    settings = Settings(home=tmp_path / "home", work_dir=tmp_path / "shared" / "work", database_url=database_url,
                        storage_url=str(tmp_path / "objects"))
    dead_run = scratch.make_run_dir(scratch.run_dir(settings, "ftjob-dead", 1))
    kept = [TinkerRunner(settings, worker_id="w").scratch / "state", ServingWorker(settings, []).scratch / "adapter",
            eval_runner.work_dir(settings, "eval-x")]
    for path in kept:
        path.mkdir(parents=True)
    assert dead_run in scratch.sweep(settings)
    assert not dead_run.exists() and all(path.is_dir() for path in kept)
