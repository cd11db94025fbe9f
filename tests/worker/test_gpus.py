"""`cispo worker --concurrency N`: N jobs at once, one per GPU (worker/gpus.py, worker/cli.py)."""

from __future__ import annotations

import pytest

from worker.cli import build_parser, cmd_worker
from worker.gpus import concurrency_error, pin_gpu


def test_each_pool_child_sees_only_its_own_gpu():
    for index, device in enumerate(["3", "5", "GPU-abc"]):
        env = {"CUDA_VISIBLE_DEVICES": "3,5,GPU-abc"}
        assert pin_gpu(index, 3, env) == device and env["CUDA_VISIBLE_DEVICES"] == device


def test_one_job_at_a_time_keeps_every_gpu_and_a_cpu_worker_pins_nothing():
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert pin_gpu(0, 1, env) is None and env["CUDA_VISIBLE_DEVICES"] == "0,1"  # a 2-GPU job needs both
    env = {"CUDA_VISIBLE_DEVICES": ""}
    assert pin_gpu(1, 2, env) is None and env["CUDA_VISIBLE_DEVICES"] == ""


def test_more_jobs_than_gpus_or_a_solo_pool_are_refused_with_the_reason():
    assert "sees 2 GPU(s)" in concurrency_error(3, "prefork", {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert "--pool prefork" in concurrency_error(2, "solo", {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert concurrency_error(2, "prefork", {"CUDA_VISIBLE_DEVICES": "0,1"}) is None
    assert concurrency_error(1, "solo", {"CUDA_VISIBLE_DEVICES": ""}) is None


def test_the_command_line_and_the_setting_choose_the_concurrency(monkeypatch, capsys):
    args = build_parser().parse_args(["worker", "--concurrency", "4"])
    assert args.concurrency == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--concurrency", "0"])
    assert "a number of jobs from 1 to 64" in capsys.readouterr().err
    # Refused before Celery starts: the setting applies when the option is not given.
    monkeypatch.setenv("CISPO_WORKER_CONCURRENCY", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    from service.settings import get_settings
    get_settings.cache_clear()
    try:
        assert cmd_worker(build_parser().parse_args(["worker"])) == 2
    finally:
        get_settings.cache_clear()
    assert "--concurrency 3 runs one job per GPU, but this worker sees 1 GPU(s)" in capsys.readouterr().err
