"""An eval run on the tiny model under its lease (worker/jobs/eval_runner.py): scored in chunks, it ends `cancelled`
when a cancel arrives while it runs, and stops without a write once its lease is no longer its own."""

from __future__ import annotations

import json
import threading
import time

import pytest

from service.repositories import evals
from tests.service.api.conftest import running_api, uploaded
from worker.jobs import eval_runner

REWARD = {"type": "exact_match", "field": "answer"}


@pytest.fixture
def api(postgres_url, tmp_path, toy_dir):
    with running_api(postgres_url, tmp_path, heartbeat_s=0.2, lease_ttl_s=30) as built:
        built.model = str(toy_dir / "model")
        yield built


def _queued(api, rows: int) -> str:
    file_id = uploaded(api.client, [{"prompt": f"Say {i}", "answer": str(i)} for i in range(rows)])
    r = api.client.post("/v1/evals", json={"model": api.model, "file": file_id, "reward": REWARD, "max_rows": rows,
                                           "sampling": {"max_output_tokens": 2, "max_model_len": 32}})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _in_thread(eval_id: str, settings) -> tuple[threading.Thread, dict]:
    ended = {}
    thread = threading.Thread(target=lambda: ended.update(status=eval_runner.run_eval(eval_id, settings)))
    thread.start()
    return thread, ended


def _wait_running(api, eval_id: str) -> None:
    deadline = time.monotonic() + 30
    while api.client.get(f"/v1/evals/{eval_id}").json()["status"] != "running":
        assert time.monotonic() < deadline, "the eval run was never claimed"
        time.sleep(0.02)


def test_rows_scored_in_chunks_come_back_whole_and_in_order(api, monkeypatch):
    monkeypatch.setattr(eval_runner, "CHUNK_ROWS", 3)
    eval_id = _queued(api, 7)
    assert eval_runner.run_eval(eval_id, api.app.state.settings) == "succeeded"
    run = api.client.get(f"/v1/evals/{eval_id}").json()
    assert run["result"]["n"] == 7 and run["result_counts"] == {"total": 7, "errored": 0}
    content = api.client.get(f"/v1/files/{run['result_files'][0]}/content").text
    rows = [json.loads(line) for line in content.splitlines()]
    assert [r["row"] for r in rows] == list(range(7))
    assert [r["prompt"].split()[-1] for r in rows] == [str(i) for i in range(7)]
    with api.session() as s:
        assert evals.get_for_worker(s, eval_id).lease_expires_at is None  # the lease ended with the run


def test_a_cancel_while_it_runs_ends_the_run_cancelled_without_a_result(api):
    eval_id = _queued(api, 64)
    thread, ended = _in_thread(eval_id, api.app.state.settings)
    _wait_running(api, eval_id)
    r = api.client.post(f"/v1/evals/{eval_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "running"  # asked; the worker ends it
    thread.join(120)
    assert ended["status"] == "cancelled"
    run = api.client.get(f"/v1/evals/{eval_id}").json()
    assert (run["status"], run["result"], run["result_files"]) == ("cancelled", None, [])


def test_a_run_whose_lease_was_given_up_stops_and_leaves_the_failure_standing(api):
    eval_id = _queued(api, 64)
    # A lease that lapses at once and no background renewal: the reconciler's sweep finds it expired.
    settings = api.app.state.settings.model_copy(update={"lease_ttl_s": 0.01, "heartbeat_s": 600})
    thread, ended = _in_thread(eval_id, settings)
    _wait_running(api, eval_id)
    # The run renews before each chunk, so a sweep may land inside a 10 ms renewal; the reconciler sweeps again.
    deadline = time.monotonic() + 30
    while True:
        with api.session() as s:
            swept = evals.fail_expired(s)
            s.commit()
        if swept:
            break
        assert time.monotonic() < deadline, "the lease never lapsed"
        time.sleep(0.02)
    assert swept == [eval_id]
    thread.join(120)
    assert ended["status"] is None  # no longer its run: nothing written
    run = api.client.get(f"/v1/evals/{eval_id}").json()
    assert (run["status"], run["error"]["code"], run["result"]) == ("failed", "worker_lost", None)
