"""The Tinker API's request rows (service/repositories/tinker.py) on SQLite and PostgreSQL: retries dedupe, a
model's requests are claimed in seq_id order with a bounded wait for a missing one, two runners never take one
row, a dead runner's work fails, and heartbeats that stop release models."""

from __future__ import annotations

import threading
import time

import pytest

from service.db.session import session_factory
from service.repositories import projects
from service.repositories import tinker as repo


def _project(url: str, name: str = "alpha") -> str:
    with session_factory(url)() as s:
        project_id = projects.get_or_create_project(s, name).id
        s.commit()
    return project_id


def _model(url: str, project_id: str) -> tuple[str, str]:
    with session_factory(url)() as s:
        session_id = repo.create_session(s, project_id, tags=[], user_metadata=None, sdk_version="0.38.0")
        model_id = repo.add_model(s, project_id, session_id, 0, base_model="base", lora_config={"rank": 4})
        s.commit()
    return session_id, model_id


def _submit(url: str, project_id: str, model_id: str | None, seq_id: int | None, kind: str = "forward_backward",
            **extra) -> str:
    with session_factory(url)() as s:
        request_id, _ = repo.submit(s, project_id, kind=kind, body=b"{}", body_type="json", model_id=model_id,
                                    seq_id=seq_id, **extra)
        s.commit()
    return request_id


def _claim(url: str, worker: str = "w1", now_s: float | None = None) -> list[repo.RequestRow]:
    with session_factory(url)() as s:
        rows = repo.claim_ready(s, worker, time.time() if now_s is None else now_s)
        s.commit()
    return rows


def _complete(url: str, request_id: str) -> None:
    with session_factory(url)() as s:
        assert repo.complete(s, request_id, b'{"ok":1}', "json")
        s.commit()


def test_a_retry_of_the_same_model_and_seq_id_answers_the_first_request(database_url):
    project_id = _project(database_url)
    _, model_id = _model(database_url, project_id)
    first = _submit(database_url, project_id, model_id, 1)
    assert _submit(database_url, project_id, model_id, 1) == first
    assert _submit(database_url, project_id, model_id, 2) != first
    with session_factory(database_url)() as s:
        assert repo.get_request(s, project_id, first).seq_id == 1


def test_racing_retries_add_one_row(database_url):
    project_id = _project(database_url)
    _, model_id = _model(database_url, project_id)
    ids: list[str] = []
    barrier = threading.Barrier(4)

    def retry():
        barrier.wait()
        ids.append(_submit(database_url, project_id, model_id, 7))

    threads = [threading.Thread(target=retry) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 4 and len(set(ids)) == 1


def test_a_models_requests_are_claimed_one_at_a_time_in_seq_id_order(database_url):
    project_id = _project(database_url)
    _, model_id = _model(database_url, project_id)
    for seq in (2, 0, 1):  # arrival order is not run order
        _submit(database_url, project_id, model_id, seq, kind="create_model" if seq == 0 else "forward_backward")
    order = []
    for _ in range(3):
        claimed = _claim(database_url)
        assert len(claimed) == 1 and _claim(database_url, "w1") == []  # the next waits for this one to end
        order.append(claimed[0].seq_id)
        _complete(database_url, claimed[0].id)
    assert order == [0, 1, 2]


def test_requests_of_no_model_are_ready_at_once_and_models_do_not_wait_for_each_other(database_url):
    project_id = _project(database_url)
    _, first = _model(database_url, project_id)
    _, second = _model(database_url, project_id)
    a = _submit(database_url, project_id, first, 0, kind="create_model")
    b = _submit(database_url, project_id, second, 0, kind="create_model")
    sample = _submit(database_url, project_id, None, None, kind="asample")
    assert {r.id for r in _claim(database_url)} == {a, b, sample}


def test_a_missing_lower_seq_id_is_waited_for_only_for_the_grace(database_url):
    project_id = _project(database_url)
    _, model_id = _model(database_url, project_id)
    _complete_create(database_url, project_id, model_id)
    late_chunk = _submit(database_url, project_id, model_id, 2)  # seq 1 (the first chunk) has not arrived
    t = time.time()
    assert _claim(database_url, now_s=t) == []
    claimed = _claim(database_url, now_s=t + repo.GAP_GRACE_S + 0.5)
    assert [r.id for r in claimed] == [late_chunk]


def test_a_missing_lower_seq_id_that_arrives_within_the_grace_runs_first(database_url):
    project_id = _project(database_url)
    _, model_id = _model(database_url, project_id)
    _complete_create(database_url, project_id, model_id)
    _submit(database_url, project_id, model_id, 2)
    first_chunk = _submit(database_url, project_id, model_id, 1)
    assert [r.id for r in _claim(database_url)] == [first_chunk]


def _complete_create(url: str, project_id: str, model_id: str) -> None:
    _submit(url, project_id, model_id, 0, kind="create_model")
    (created,) = _claim(url)
    _complete(url, created.id)


def test_a_model_is_run_by_the_runner_that_holds_it(database_url):
    project_id = _project(database_url)
    _, model_id = _model(database_url, project_id)
    _submit(database_url, project_id, model_id, 0, kind="create_model")
    (created,) = _claim(database_url, "w1")
    _complete(database_url, created.id)
    step = _submit(database_url, project_id, model_id, 1)
    assert _claim(database_url, "w2") == []
    assert [r.id for r in _claim(database_url, "w1")] == [step]


def test_complete_and_fail_only_end_open_requests(database_url):
    project_id = _project(database_url)
    request_id = _submit(database_url, project_id, None, None, kind="asample")
    with session_factory(database_url)() as s:
        assert not repo.complete(s, request_id, b"x", "protobuf")  # not claimed yet
    _claim(database_url)
    with session_factory(database_url)() as s:
        assert repo.complete(s, request_id, b"\x01\x02", "protobuf")
        assert not repo.fail(s, request_id, "late", "server")
        s.commit()
        row = repo.get_request(s, project_id, request_id)
    assert (row.state, row.result, row.result_type) == ("done", b"\x01\x02", "protobuf")
    with session_factory(database_url)() as s, pytest.raises(ValueError):
        repo.fail(s, request_id, "x", "bogus")


def test_a_dead_runners_running_and_held_requests_fail_as_server_errors(database_url):
    project_id = _project(database_url)
    _, model_id = _model(database_url, project_id)
    _submit(database_url, project_id, model_id, 0, kind="create_model")
    (created,) = _claim(database_url, "w1")
    waiting = _submit(database_url, project_id, model_id, 1)
    with session_factory(database_url)() as s:
        assert set(repo.fail_running_of(s, "w1", "the runner stopped")) == {created.id, waiting}
        s.commit()
        rows = [repo.get_request(s, project_id, i) for i in (created.id, waiting)]
    assert {(r.state, r.error_category, r.error) for r in rows} == {("failed", "server", "the runner stopped")}


def test_a_runner_that_stops_renewing_its_holds_has_them_ended_and_its_clients_told(database_url):
    """A runner that died for good (a pod gone, another hostname next time): once its holds are older than
    HOLD_TTL_S, any runner ends them, the held model's waiting requests fail as server errors, and the model is
    free; a hold renewed in time stays."""
    project_id = _project(database_url)
    _, dead_model = _model(database_url, project_id)
    _, live_model = _model(database_url, project_id)
    t0 = time.time()
    for model_id, worker in ((dead_model, "dead"), (live_model, "live")):
        _submit(database_url, project_id, model_id, 0, kind="create_model")
        (created,) = _claim(database_url, worker, now_s=t0)
        _complete(database_url, created.id)
    waiting = _submit(database_url, project_id, dead_model, 1)
    later = t0 + repo.HOLD_TTL_S + 1
    with session_factory(database_url)() as s:
        repo.renew_holds(s, "live", later - 1)
        assert repo.abandoned_holds(s, t0 + 1) == []  # not stale yet
        assert repo.abandoned_holds(s, later) == [waiting]
        s.commit()
        row = repo.get_request(s, project_id, waiting)
        holders = {m: repo.get_model(s, project_id, m).worker_id for m in (dead_model, live_model)}
    assert (row.state, row.error_category) == ("failed", "server") and "resume" in row.error
    assert holders == {dead_model: None, live_model: "live"}


def test_stopped_heartbeats_end_the_session_and_release_its_models(database_url):
    project_id = _project(database_url)
    silent_session, silent = _model(database_url, project_id)
    time.sleep(0.3)
    live_session, live = _model(database_url, project_id)
    with session_factory(database_url)() as s:
        repo.record_checkpoint(s, path=repo.checkpoint_path(silent, "weights", "final"), project_id=project_id,
                               model_id=silent, kind="weights", storage_key="k")
        assert repo.heartbeat(s, project_id, live_session) is True
        s.commit()
    orphan = _submit(database_url, project_id, silent, 1, session_id=silent_session)
    kept = _submit(database_url, project_id, live, 1, session_id=live_session)
    with session_factory(database_url)() as s:
        assert repo.expire_sessions(s, time.time(), 0.2) == [silent]
        s.commit()
        assert repo.get_request(s, project_id, orphan).state == "failed"  # nobody waits for it any more
        assert repo.get_request(s, project_id, kept).state == "pending"
    with session_factory(database_url)() as s:
        assert repo.heartbeat(s, project_id, silent_session) is False  # the API answers 410
        assert repo.heartbeat(s, project_id, "tsess_unknown") is None
        assert repo.get_model(s, project_id, silent).released_at is not None
        assert repo.get_model(s, project_id, live).released_at is None
        assert repo.live_models(s, project_id) == 1
        # what it saved stays
        assert repo.resolve_checkpoint(s, project_id, repo.checkpoint_path(silent, "weights", "final")) is not None


def test_two_runners_never_claim_the_same_request(database_url):
    project_id = _project(database_url)
    ids = {_submit(database_url, project_id, None, None, kind="asample") for _ in range(40)}
    claims: dict[str, list[str]] = {"w1": [], "w2": []}
    barrier = threading.Barrier(2)

    def run(worker: str):
        barrier.wait()
        for _ in range(10):
            claims[worker] += [r.id for r in _claim(database_url, worker)]

    threads = [threading.Thread(target=run, args=(w,)) for w in claims]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(claims["w1"]).isdisjoint(claims["w2"])
    assert sorted(claims["w1"] + claims["w2"]) == sorted(ids)


def test_a_checkpoint_resolves_only_for_its_project(database_url):
    alpha, beta = _project(database_url, "alpha"), _project(database_url, "beta")
    _, model_id = _model(database_url, alpha)
    path = repo.checkpoint_path(model_id, "sampler_weights", "000002")
    with session_factory(database_url)() as s:
        repo.record_checkpoint(s, path=path, project_id=alpha, model_id=model_id, kind="sampler_weights",
                               storage_key="one")
        repo.record_checkpoint(s, path=path, project_id=alpha, model_id=model_id, kind="sampler_weights",
                               storage_key="two")  # an overwrite
        s.commit()
        assert repo.resolve_checkpoint(s, alpha, path).storage_key == "two"
        assert repo.resolve_checkpoint(s, beta, path) is None
        assert repo.saved_checkpoints(s, alpha) == 1 and repo.saved_checkpoints(s, beta) == 0


def test_an_ended_request_keeps_its_result_not_its_body_and_goes_after_the_retention(database_url):
    project_id = _project(database_url)
    ended, pending = (_submit(database_url, project_id, None, None, kind="asample") for _ in range(2))
    with session_factory(database_url)() as s:
        (claimed, _) = repo.claim_ready(s, "w1", time.time(), limit=2)
        assert repo.complete(s, ended, b"result", "protobuf") and repo.fail(s, pending, "gave up", "user")
        late = repo.submit(s, project_id, kind="asample", body=b"{}", body_type="json")[0]
        s.commit()
        assert repo.get_request(s, project_id, ended).body == b""
        assert repo.prune_ended(s, time.time() - 60) == 0  # not yet
        assert repo.prune_ended(s, time.time() + 1) == 2
        s.commit()
        assert repo.get_request(s, project_id, ended) is None
        assert repo.get_request(s, project_id, late).state == "pending"  # open requests stay


def _publish(url: str, model_id: str, step: int, name: str = "v") -> tuple[str, str]:
    with session_factory(url)() as s:
        ckpt = repo.publish_sampler_weights(s, model_id, path=f"tinker://{model_id}/sampler_weights/{name}",
                                            storage_key=f"tinker/p/{name}", files={"adapter/a": {"sha256": name}},
                                            lora={"r": 4, "alpha": 8.0, "target_modules": ["q_proj"]}, step=step)
        s.commit()
        return ckpt.job_id, ckpt.id


def test_sampler_weights_are_a_fine_tuned_model_of_the_project_with_a_checkpoint_per_step(database_url):
    from service.models import fine_tuned
    from service.models.start import resolve
    from service.repositories import fine_tuned_models, jobs

    project_id, beta = _project(database_url), _project(database_url, "beta")
    _, model_id = _model(database_url, project_id)
    job_id, first = _publish(database_url, model_id, 3, "a")
    assert _publish(database_url, model_id, 5, "b")[0] == job_id  # one model per training client
    again_job, again = _publish(database_url, model_id, 5, "c")  # the same step saved again replaces it
    assert again_job == job_id
    with session_factory(database_url)() as s:
        job = fine_tuned_models.get(s, project_id, job_id)
        assert (job.status, job.method["type"], job.steps_done, job.model) == ("succeeded", "tinker", 5, "base")
        name = fine_tuned.model_id(job, "alpha")
        assert name == f"ft:base:alpha:tinker:{job_id}"
        assert sorted(c.step for c in jobs.checkpoints(s, job_id, after=None, limit=10).items) == [3, 5]
        assert jobs.checkpoint_at_step(s, job_id, 3).id == first
        latest = jobs.latest_checkpoint(s, job_id)
        assert (latest.id, latest.storage_prefix, latest.metrics["tinker_path"]) == (
            again, "tinker/p/c", f"tinker://{model_id}/sampler_weights/c")
        start = resolve(s, project_id, name)  # what chat, evals and new jobs start from
        assert (start.checkpoint_id, start.base_model, start.lora["r"]) == (again, "base", 4)
        assert fine_tuned_models.get(s, beta, job_id) is None  # not another project's
        fine_tuned_models.retire(s, job)
        s.commit()
    assert _publish(database_url, model_id, 6, "d")[0] != job_id  # a deleted model's later save is a new model
