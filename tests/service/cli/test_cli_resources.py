"""`cispo files`, `cispo models`, `cispo evals`, and what `cispo jobs create` does with local files (reuse by
sha256; a dry run uploads nothing), as a user runs them: separate processes against a real uvicorn API."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
import time

import pytest

from service.db.models import File, new_id
from service.db.session import session_factory
from service.repositories import evals as evals_repo
from service.repositories import files as files_repo
from tests.service.api.conftest import TRAIN_ROWS, jsonl
from tests.service.api.live_server import live_api
from tests.service.cli.test_cli_jobs import REWARD, cli_env, cispo
from tests.service.api.trained import train

CREATE = ["create", "--model", "tiny-model", "--training-file", "train.jsonl", "--reward", REWARD, "--steps", "3"]


@pytest.fixture
def live(tmp_path):
    with live_api(tmp_path) as api:
        yield api


def client_cmd(live, *args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], env=cli_env(live), capture_output=True,
                          timeout=60, cwd=cwd)


def _files(live) -> list[dict]:
    with live.client() as http:
        return http.get("/v1/files").json()["data"]


def test_a_dry_run_uploads_nothing_and_create_reuses_an_uploaded_file_by_sha256(live, tmp_path):
    (tmp_path / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    dry = cispo(live, *CREATE, "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert any(line.split()[:2] == ["passed", "reward_fields"] for line in dry.stdout.splitlines())
    assert _files(live) == [] and not list((tmp_path / "objects").rglob("files/*"))  # no row, no stored bytes
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(jsonl(TRAIN_ROWS) + b'{"answer": "no prompt"}\n')
    refused = cispo(live, *CREATE[:3], "--training-file", str(bad), "--reward", REWARD, "--dry-run")
    assert refused.returncode == 3 and "training_file: 1 invalid row(s): line 6" in refused.stderr, refused.stderr
    assert _files(live) == []

    first = cispo(live, *CREATE, cwd=tmp_path)
    assert first.returncode == 0 and "uploaded train.jsonl as file-" in first.stderr, first.stderr
    [uploaded] = _files(live)
    assert uploaded["sha256"] == hashlib.sha256(jsonl(TRAIN_ROWS)).hexdigest()
    again = cispo(live, *CREATE, cwd=tmp_path)
    assert again.returncode == 0 and f"reusing {uploaded['id']} for train.jsonl" in again.stderr, again.stderr
    dry_again = cispo(live, *CREATE, "--dry-run", cwd=tmp_path)
    assert dry_again.returncode == 0 and f"reusing {uploaded['id']}" in dry_again.stderr
    assert [f["id"] for f in _files(live)] == [uploaded["id"]]  # one file for three uses
    with live.client() as http:
        jobs = http.get("/v1/fine_tuning/jobs").json()["data"]
    assert {j["training_file"] for j in jobs} == {uploaded["id"]} and len(jobs) == 2


def test_files_commands_list_upload_print_save_and_delete(live, tmp_path):
    content = jsonl(TRAIN_ROWS)
    (tmp_path / "train.jsonl").write_bytes(content)
    up = client_cmd(live, "files", "upload", "train.jsonl", cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    file_id = up.stdout.decode().strip()
    same = client_cmd(live, "files", "upload", "train.jsonl", cwd=tmp_path)
    assert same.stdout.decode().strip() == file_id and b"reusing" in same.stderr
    forced = client_cmd(live, "files", "upload", "train.jsonl", "--force", cwd=tmp_path).stdout.decode().strip()
    assert forced != file_id
    listed = client_cmd(live, "files", "list").stdout.decode().splitlines()
    assert listed[0].split() == ["ID", "BYTES", "PURPOSE", "CREATED", "(UTC)", "FILENAME"]
    assert [line.split()[0] for line in listed[1:]] == [forced, file_id]
    assert client_cmd(live, "files", "content", file_id).stdout == content
    saved = client_cmd(live, "files", "download", file_id, "-o", str(tmp_path / "copy.jsonl"))
    assert saved.returncode == 0 and (tmp_path / "copy.jsonl").read_bytes() == content
    assert json.loads(client_cmd(live, "files", "get", file_id).stdout)["bytes"] == len(content)
    gone = client_cmd(live, "files", "delete", forced)
    assert gone.returncode == 0 and gone.stdout.decode().strip() == f"deleted {forced}"
    missing = client_cmd(live, "files", "content", forced)
    assert missing.returncode == 3 and b"no such file" in missing.stderr and b"Traceback" not in missing.stderr


def test_models_and_evals_commands_and_an_eval_runs_results_fetched_by_the_cli(live, tmp_path):
    (tmp_path / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    job_id = cispo(live, *CREATE, "--suffix", "cli", cwd=tmp_path).stdout.strip()
    train(live.database_url, live.store, job_id)
    model = f"ft:tiny-model:alpha:cli:{job_id}"
    listed = client_cmd(live, "models", "list").stdout.decode().splitlines()
    assert listed[1].split()[:2] == [model, "tiny-model"] and listed[1].split()[-1] == job_id
    assert json.loads(client_cmd(live, "models", "show", model).stdout)["fine_tuning_job_id"] == job_id

    file_id = _files(live)[0]["id"]
    with live.client() as http:
        run = http.post("/v1/evals", json={"model": model, "file": file_id, "max_rows": 5}).json()
    waiting = client_cmd(live, "evals", "get", run["id"])
    assert waiting.stdout.decode().split() == [run["id"], "queued"]
    early = client_cmd(live, "evals", "results", run["id"])
    assert early.returncode == 2 and b"has no results file (status queued)" in early.stderr
    results = b'{"row": 0, "prompt": "Say alpha", "completion": "alpha", "reward": 1.0}\n'
    _finish_eval(live, run["id"], results)
    done = client_cmd(live, "evals", "get", run["id"]).stdout.decode()
    assert f"{model}: mean reward 1.0000" in done and "[0.2065, 1.0000]" in done and "+/-" not in done
    assert client_cmd(live, "evals", "results", run["id"]).stdout == results
    assert [line.split()[:2] for line in client_cmd(live, "evals", "list").stdout.decode().splitlines()[1:]] == \
        [[run["id"], "succeeded"]]

    deleted = client_cmd(live, "models", "delete", model)
    assert deleted.returncode == 0 and deleted.stdout.decode().startswith(f"deleted {model}")
    assert client_cmd(live, "models", "list").stdout.decode().splitlines()[1:] == []


def _finish_eval(live, eval_id: str, content: bytes) -> None:
    """What a worker writes when an eval run ends (worker/jobs/eval_runner.py): a results file and the interval."""
    file_id = new_id("file-")
    live.store.put_bytes(f"files/{file_id}", content)
    with session_factory(live.database_url).begin() as s:
        run = evals_repo.get_for_worker(s, eval_id)
        files_repo.add(s, File(id=file_id, project_id=run.project_id, filename=f"{eval_id}-results.jsonl",
                               purpose="evals", bytes=len(content), sha256=hashlib.sha256(content).hexdigest(),
                               rows=1, storage_key=f"files/{file_id}"))
        assert evals_repo.claim(s, eval_id, "test-worker")
        assert evals_repo.finish(s, eval_id, "test-worker", status="succeeded", result_file_id=file_id, result={
            "mean": 1.0, "interval": [0.2065, 1.0], "method": "wilson", "n": 1, "errors": 0})


def test_bad_usage_is_a_message_and_exit_2_never_a_traceback_or_the_servers_422(live, tmp_path):
    missing_spec = cispo(live, "create", str(tmp_path / "nope.yaml"))
    assert missing_spec.returncode == 2 and "SPEC: no such file:" in missing_spec.stderr
    assert "Traceback" not in missing_spec.stderr
    (tmp_path / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    glued = cispo(live, *CREATE[:5], "--reward", "{type:exact}", cwd=tmp_path)
    assert glued.returncode == 2 and "'type:exact' reads as one field name" in glued.stderr, glued.stderr
    assert "{type: exact_match, field: answer}" in glued.stderr and "discriminator" not in glued.stderr
    untyped = cispo(live, *CREATE[:5], "--reward", '{"field": "answer"}', cwd=tmp_path)
    assert untyped.returncode == 2 and "--reward: no 'type' field" in untyped.stderr
    bare = cispo(live, "create")
    assert bare.returncode == 2 and bare.stderr.startswith("usage: ") and "a job needs --model" in bare.stderr
    assert "HTTP" not in bare.stderr
    assert _files(live) == []


def test_an_export_carries_the_time_it_was_saved_not_1970(live, tmp_path):
    payload = b"lora weights"
    manifest = {"files": {"adapter/adapter_model.safetensors": {"sha256": hashlib.sha256(payload).hexdigest()}}}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:  # as the API writes it: every mtime 0
        for name, data in (("adapter/adapter_model.safetensors", payload),
                           ("manifest.json", json.dumps(manifest).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    job_id = cispo(live, *CREATE, cwd=tmp_path).stdout.strip()
    train(live.database_url, live.store, job_id, tar=buffer.getvalue())
    before = time.time() - 1
    done = cispo(live, "export", job_id, "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    for path in (tmp_path / "out", tmp_path / "out" / "adapter_model.safetensors"):
        assert path.stat().st_mtime >= before, path
