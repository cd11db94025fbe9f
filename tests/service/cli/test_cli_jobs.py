"""`cispo jobs` as a user runs it: a separate process against a real uvicorn API (PostgreSQL, Redis)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import pytest

from tests.service.api.conftest import TRAIN_ROWS, jsonl
from tests.service.api.live_server import live_api
from tests.service.api.trained import train
from tests.conftest import free_port

REWARD = '{"type": "exact_match", "field": "answer"}'


@pytest.fixture
def live(tmp_path):
    with live_api(tmp_path) as api:
        yield api


def cli_env(live, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CISPO_API_")}
    return {**env, "CISPO_API_URL": live.base, "CISPO_API_KEY": live.key, **extra}


def cispo(live, *args, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker.cli", "jobs", *args], env=env or cli_env(live),
                          capture_output=True, text=True, timeout=60, cwd=cwd)


def start(live, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "worker.cli", "jobs", *args], env=cli_env(live),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def first_line(proc: subprocess.Popen, timeout: float = 30) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no output in time"
    return proc.stdout.readline()


def test_create_list_get_control_and_clear_errors(live, tmp_path):
    (tmp_path / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    made = cispo(live, "create", "--model", "tiny-model", "--training-file", "train.jsonl", "--reward", REWARD,
                 "--steps", "3", "--suffix", "cli", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    job_id = made.stdout.strip()
    assert job_id.startswith("ftjob-") and "uploaded train.jsonl as file-" in made.stderr

    listed = cispo(live, "list")
    assert listed.returncode == 0
    assert any(line.split()[:3] == [job_id, "queued", "0/3"] for line in listed.stdout.splitlines())
    job = json.loads(cispo(live, "get", job_id).stdout)
    assert job["user_provided_suffix"] == "cli" and job["total_steps"] == 3
    assert job["method"]["cispo"]["reward"] == json.loads(REWARD)

    # A SPEC file: the request body as YAML, its training file a local path the CLI uploads.
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model: tiny-model\ntraining_file: {tmp_path / 'train.jsonl'}\nseed: 5\nmethod:\n"
                    f"  type: cispo\n  cispo:\n    reward: {REWARD}\n")
    from_spec = cispo(live, "create", str(spec), "--steps", "2", "--json")
    assert from_spec.returncode == 0, from_spec.stderr
    assert json.loads(from_spec.stdout)["seed"] == 5 and json.loads(from_spec.stdout)["total_steps"] == 2

    for action, status in (("pause", "paused"), ("resume", "queued"), ("cancel", "cancelled")):
        done = cispo(live, action, job_id)
        assert (done.returncode, done.stdout.split()) == (0, [job_id, status]), done.stderr
    again = cispo(live, "cancel", job_id)
    assert again.returncode == 3 and "cannot be cancelled" in again.stderr and "HTTP 409" in again.stderr
    assert "Traceback" not in again.stderr

    bad = cispo(live, "create", "--model", "tiny-model", "--training-file", "file-nope", "--reward", REWARD)
    assert bad.returncode == 3 and "training_file: no such file: file-nope" in bad.stderr
    assert "param: training_file" in bad.stderr
    missing = cispo(live, "create", "--training-file", "no-such.jsonl", "--reward", REWARD, cwd=tmp_path)
    assert missing.returncode == 2 and "neither a file id" in missing.stderr

    no_key = cispo(live, "list", env={**cli_env(live), "CISPO_API_KEY": ""})
    assert no_key.returncode == 2 and "CISPO_API_KEY" in no_key.stderr
    wrong_key = cispo(live, "list", "--api-key", "sk-wrong")
    assert wrong_key.returncode == 3 and "invalid API key" in wrong_key.stderr
    down = cispo(live, "list", "--api-url", f"http://127.0.0.1:{free_port()}")
    assert down.returncode == 4 and "cannot reach the API" in down.stderr


def test_watch_and_follow_until_the_job_ends_then_download_verified(live, tmp_path):
    (tmp_path / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    job_id = cispo(live, "create", "--model", "tiny-model", "--training-file", "train.jsonl", "--reward", REWARD,
                   "--steps", "3", "--suffix", "cli", cwd=tmp_path).stdout.strip()
    watch = start(live, "watch", job_id, "--interval", "0.2")
    follow = start(live, "logs", job_id, "--follow", "--interval", "0.2")
    try:
        assert first_line(watch).split()[:4] == [job_id, "queued", "[------------------------]", "0/3"]
        assert first_line(follow).endswith("Job created\n")
        ckpt = train(live.database_url, live.store, job_id)
        watched, _ = watch.communicate(timeout=30)
        followed, _ = follow.communicate(timeout=30)
    finally:
        for proc in (watch, follow):
            proc.kill()
    assert watch.returncode == 0 and follow.returncode == 0
    assert f"{job_id}  succeeded  [########################] 3/3 steps  reward 0.6000" in watched
    assert watched.rstrip().endswith(f"fine-tuned model: ft:tiny-model:alpha:cli:{job_id}")
    messages = [line.split(None, 3)[3] for line in followed.splitlines()]  # date, time, level, message
    assert messages == ["Training started", "Step 1: reward 0.1", "Step 2: reward 0.35", "Step 3: reward 0.6",
                        "Checkpoint saved at step 3", "Job succeeded"]

    out = tmp_path / "adapter.tar"
    got = cispo(live, "download", job_id, "-o", str(out))
    assert got.returncode == 0, got.stderr
    assert out.read_bytes() == ckpt["tar"] and ckpt["sha256"] in got.stdout

    # The stored bytes change under the recorded hash: the CLI refuses them and saves nothing.
    live.store.put_bytes(f"{ckpt['prefix']}/adapter.tar", b"corrupted" + ckpt["tar"][9:])
    corrupt = tmp_path / "corrupt.tar"
    refused = cispo(live, "download", job_id, "-o", str(corrupt))
    assert refused.returncode == 1 and "does not match" in refused.stderr
    assert not corrupt.exists() and not (tmp_path / "corrupt.tar.part").exists()


def test_queued_jobs_show_their_place_in_the_queue(live, tmp_path):
    (tmp_path / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    first, second = (cispo(live, "create", "--model", "tiny-model", "--training-file", "train.jsonl", "--reward",
                           REWARD, "--steps", "3", cwd=tmp_path).stdout.strip() for _ in range(2))

    def listed() -> dict[str, list[str]]:
        lines = cispo(live, "list").stdout.splitlines()
        assert lines[0].split()[:4] == ["ID", "STATUS", "STEPS", "QUEUE"]
        return {line.split()[0]: line.split()[:4] for line in lines[1:]}

    assert listed() == {first: [first, "queued", "0/3", "#1"], second: [second, "queued", "0/3", "#2"]}
    assert json.loads(cispo(live, "get", second).stdout)["queue_position"] == 2
    watch = start(live, "watch", second, "--interval", "0.2")
    try:
        assert first_line(watch).split()[:7] == [second, "queued", "[------------------------]", "0/3", "steps",
                                                 "#2", "in"]
    finally:
        watch.kill()
    # A job no longer queued has no place; the one behind it moves up.
    assert cispo(live, "cancel", first).returncode == 0
    assert listed() == {first: [first, "cancelled", "0/3", "-"], second: [second, "queued", "0/3", "#1"]}


def test_watch_exits_nonzero_when_the_job_does_not_succeed(live, tmp_path):
    (tmp_path / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    job_id = cispo(live, "create", "--model", "tiny-model", "--training-file", "train.jsonl", "--reward", REWARD,
                   cwd=tmp_path).stdout.strip()
    assert cispo(live, "cancel", job_id).returncode == 0
    watched = cispo(live, "watch", job_id)
    assert watched.returncode == 1 and "cancelled" in watched.stdout


def test_eval_stops_waiting_when_the_eval_run_is_cancelled(live, tmp_path):
    (tmp_path / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    job_id = cispo(live, "create", "--model", "tiny-model", "--training-file", "train.jsonl", "--reward", REWARD,
                   cwd=tmp_path).stdout.strip()
    waiting = subprocess.Popen([sys.executable, "-m", "worker.cli", "jobs", "eval", job_id, "--base", "--file",
                                str(tmp_path / "train.jsonl"), "--interval", "0.2"], env=cli_env(live),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([waiting.stderr], [], [], 30)  # no worker here: the run stays queued
        assert ready, "no output in time"
        line = waiting.stderr.readline()
        while not line.startswith("evalrun_"):
            line = waiting.stderr.readline()
        eval_id = line.split()[0]
        with live.client() as http:
            assert http.post(f"/v1/evals/{eval_id}/cancel").json()["status"] == "cancelled"
        assert waiting.wait(30) == 1
        assert f"eval run {eval_id} was cancelled" in waiting.stderr.read()
    finally:
        waiting.kill()


def test_the_cli_imports_no_torch():
    probe = "import sys, worker.cli, service.cli.jobs; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"


def test_follow_prints_the_last_events_of_a_job_that_ends_between_two_polls(api, monkeypatch, capsys):
    """Deterministic: the job ends right after the follower's second events poll (with a cached page)."""
    import argparse

    from fastapi.testclient import TestClient

    from service.cli import jobs as cli
    from service.repositories import job_lease, jobs as jobs_repo
    from tests.service.api.conftest import created_job

    cache = api.app.state.poll_cache
    cache.clock = lambda: now[0]
    now = [1000.0]
    job = created_job(api)
    with api.session() as s:
        epoch = job_lease.claim(s, job["id"], "w", ttl_s=60)
        jobs_repo.add_event(s, job["id"], "Step 1/2: loss=1")
        s.commit()

    polls = []

    def worker_ends_after_the_second_events_poll(response) -> None:
        if response.request.url.path.endswith("/events"):
            polls.append(1)
            if len(polls) == 2:
                with api.session() as s:
                    jobs_repo.add_event(s, job["id"], "Step 2/2: loss=0.5")
                    assert job_lease.finish(s, job["id"], epoch, "succeeded")
                    jobs_repo.add_event(s, job["id"], "Job succeeded")
                    s.commit()

    def sleep(_seconds) -> None:  # time passes only between polls: each poll may meet the cache
        assert len(polls) < 10, "the follower never stopped"
        now[0] += cache.ttl_s

    client = cli.Client("http://testserver", "unused")
    client.http = TestClient(api.app, base_url="http://testserver/v1", headers=dict(api.client.headers))
    client.http.event_hooks = {"response": [worker_ends_after_the_second_events_poll]}
    monkeypatch.setattr(cli.time, "sleep", sleep)
    args = argparse.Namespace(job=job["id"], limit=20, follow=True, json=False, interval=0)
    assert cli.cmd_events(args, client) == 0
    printed = capsys.readouterr().out
    assert "Step 2/2: loss=0.5" in printed and printed.rstrip().endswith("Job succeeded")


def test_every_flag_reaches_the_api_and_bad_values_fail_naming_the_field(live, tmp_path):
    (tmp_path / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    base = ["create", "--model", "tiny-model", "--training-file", "train.jsonl", "--reward", REWARD]
    zero = cispo(live, *base, "--steps", "0", cwd=tmp_path)
    assert zero.returncode == 3, zero.stdout  # was: exit 0 and a 100-step job
    assert "param: method.cispo.hyperparameters.training.steps" in zero.stderr and "Traceback" not in zero.stderr
    negative_seed = cispo(live, *base, "--seed", "-1", cwd=tmp_path)
    assert negative_seed.returncode == 3 and "param: seed" in negative_seed.stderr
    empty_reward_function = cispo(live, "create", "--model", "tiny-model", "--training-file", "train.jsonl",
                                  "--reward-function", "", cwd=tmp_path)
    assert empty_reward_function.returncode == 3 and "reward_function" in empty_reward_function.stderr
    assert cispo(live, "list", "--limit", "0").returncode == 3  # the API's bounds, named by it
    for flags in (["watch", "ftjob-x", "--interval", "0"], ["events", "ftjob-x", "--interval", "-1"]):
        local = cispo(live, *flags)
        assert local.returncode == 2 and "--interval: must be above 0" in local.stderr
    with live.client() as http:
        assert http.get("/v1/fine_tuning/jobs").json()["data"] == []  # not one job was created


def test_create_dry_run_checks_and_creates_nothing(live, tmp_path):
    (tmp_path / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    dry = cispo(live, "create", "--model", "tiny-model", "--training-file", "train.jsonl", "--reward", REWARD,
                "--steps", "3", "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert any(line.split()[:2] == ["passed", "reward_fields"] for line in lines)
    assert lines[-1] == "estimated duration: unknown"  # no earlier job measured a step rate
    as_json = json.loads(cispo(live, "create", "--model", "tiny-model", "--training-file", "train.jsonl",
                               "--reward", REWARD, "--dry-run", "--json", cwd=tmp_path).stdout)
    assert as_json["object"] == "fine_tuning.job.dry_run"
    refused = cispo(live, "create", "--model", "tiny-model", "--training-file", "train.jsonl", "--reward",
                    '{"type": "exact_match", "field": "missing"}', "--dry-run", cwd=tmp_path)
    assert refused.returncode == 3 and "dry run: 1 check(s) failed" in refused.stderr
    with live.client() as http:
        assert http.get("/v1/fine_tuning/jobs").json()["data"] == []


def test_a_reader_that_leaves_early_is_no_error(live, tmp_path):
    """`cispo jobs list | head`: the pipe's reader is gone before the output is written."""
    (tmp_path / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    for _ in range(2):
        assert cispo(live, "create", "--model", "tiny-model", "--training-file", "train.jsonl", "--reward", REWARD,
                     cwd=tmp_path).returncode == 0
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "worker.cli", "jobs", "list"], env=cli_env(live),
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert done.returncode == 0 and done.stderr == ""
