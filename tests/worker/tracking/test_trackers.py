"""A job's trackers cannot be aimed past the egress policy, never hand a server's words to the tenant, and keep
each project in its own namespace of a shared store. Against real loopback HTTP servers: a small MLflow REST
server, one that redirects to a "metadata" endpoint holding credentials, and a real MLflow file store."""

from __future__ import annotations

import json
import socket
import threading
from urllib.parse import parse_qs, urlsplit

import pytest

from service.schemas.integrations import Integration
from service.settings import Settings
from tests.loopback_http import QuietHandler, base_url, serving
from worker.tracking import trackers
from worker.tracking.trackers import Trackers

CREDENTIALS = b"AccessKeyId=AKIAEXAMPLE SecretAccessKey=wJalrXUtnFEMIEXAMPLEKEY Token=IQoJb3JpZ2lu"


class _Metadata(QuietHandler):
    hits: list[str]

    def do_GET(self):
        type(self).hits.append(self.path)
        self.answer(200, CREDENTIALS, content_type="text/plain")

    do_POST = do_GET


class _Mlflow(QuietHandler):
    """The calls worker/tracking/mlflow_rest.py makes, kept in memory; with `redirect_to` every call answers 307 there."""

    redirect_to: str | None = None
    state: dict

    def _reply(self, status: int, body: dict) -> None:
        self.answer(status, json.dumps(body).encode())

    def _route(self, payload: dict | None):
        state, lock = type(self).state, type(self).lock
        if type(self).redirect_to:
            self.send_response(307)
            self.send_header("Location", type(self).redirect_to)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path = urlsplit(self.path)
        endpoint = path.path.removeprefix("/api/2.0/mlflow/")
        with lock:
            state["requests"].append((endpoint, dict(self.headers), payload))
            experiments, runs = state["experiments"], state["runs"]
            if endpoint == "experiments/get-by-name":
                name = parse_qs(path.query)["experiment_name"][0]
                if name not in experiments:
                    return self._reply(404, {"error_code": "RESOURCE_DOES_NOT_EXIST"})
                return self._reply(200, {"experiment": {"experiment_id": experiments[name]}})
            if endpoint == "experiments/create":
                experiments[payload["name"]] = str(len(experiments) + 1)
                return self._reply(200, {"experiment_id": experiments[payload["name"]]})
            if endpoint == "runs/search":
                tag, value = payload["filter"].split("`")[1], payload["filter"].split("'")[1]
                found = [{"info": {"run_id": rid}} for rid, run in runs.items()
                         if run["experiment_id"] in payload["experiment_ids"] and run["tags"].get(tag) == value]
                return self._reply(200, {"runs": found[:1]} if found else {})
            if endpoint == "runs/create":
                rid = f"run{len(runs) + 1}"
                runs[rid] = {"experiment_id": payload["experiment_id"], "name": payload["run_name"],
                             "tags": {t["key"]: t["value"] for t in payload["tags"]}, "metrics": [], "params": {},
                             "status": "RUNNING"}
                return self._reply(200, {"run": {"info": {"run_id": rid}}})
            if endpoint == "runs/log-batch":
                run = runs[payload["run_id"]]
                run["metrics"] += [(m["step"], m["key"], m["value"]) for m in payload.get("metrics", [])]
                run["params"].update({p["key"]: p["value"] for p in payload.get("params", [])})
                return self._reply(200, {})
            if endpoint == "runs/update":
                runs[payload["run_id"]]["status"] = payload["status"]
                return self._reply(200, {})
        self._reply(404, {"error_code": "ENDPOINT_NOT_FOUND"})

    def do_GET(self):
        self._route(None)

    def do_POST(self):
        self._route(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))


def _handler(base: type, **attrs) -> type:
    return type(base.__name__, (base,), attrs)


def _mlflow_handler(**attrs) -> type:
    return _handler(_Mlflow, state={"experiments": {}, "runs": {}, "requests": []}, lock=threading.Lock(), **attrs)


def _port(server) -> int:
    return server.server_address[1]


def _start(integrations: list[dict], settings: Settings, project_id: str = "proj_alpha",
           job_id: str = "ftjob-1") -> tuple[Trackers, list[dict]]:
    """The trackers and the events that say one failed (the info event naming where a run went is
    tests/worker/tracking/test_tracker_location.py's)."""
    events: list[dict] = []

    def event(message, **kw):
        if kw.get("level") != "info":
            events.append({"message": message, **kw})

    started = Trackers([Integration.model_validate(i) for i in integrations], job_id, settings, {"steps": 3},
                       event, project_id=project_id)
    return started, events


def test_a_redirect_to_the_metadata_endpoint_is_not_followed_and_its_body_never_reaches_the_events(tmp_path):
    metadata = _handler(_Metadata, hits=[])
    with serving(metadata) as meta, serving(_mlflow_handler()) as mlflow:
        mlflow.RequestHandlerClass.redirect_to = \
            f"{base_url(meta)}/latest/meta-data/iam/security-credentials/role"
        # The tracking server is allow-listed (by port); the metadata endpoint on another port is not.
        settings = Settings(home=tmp_path, egress_allow=f"127.0.0.1:{_port(mlflow)}")
        started, events = _start([{"type": "mlflow", "mlflow": {"tracking_uri": base_url(mlflow)}}], settings)
    assert metadata.hits == []  # never fetched
    assert started.live == {}
    [event] = events
    assert event["level"] == "error" and "redirect (HTTP 307)" in event["message"]
    for secret in ("AccessKeyId", "SecretAccessKey", "AKIAEXAMPLE", "IQoJb3JpZ2lu"):
        assert secret not in event["message"]


def test_every_tracking_request_is_checked_when_it_connects(tmp_path, monkeypatch):
    """A name that resolved to an allowed address when the run started and to the metadata address later (DNS
    rebinding) is refused at the next request, which never leaves the worker."""
    real = socket.getaddrinfo
    answer = {"tracker.example": "127.0.0.1"}

    def resolver(host, port, *args, **kw):
        return real(answer.get(host, host), port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    with serving(_mlflow_handler()) as mlflow:
        settings = Settings(home=tmp_path, egress_allow=f"127.0.0.1:{_port(mlflow)}")
        uri = f"http://tracker.example:{_port(mlflow)}"
        started, events = _start([{"type": "mlflow", "mlflow": {"tracking_uri": uri, "experiment": "x"}}], settings)
        started.log(1, {"reward_mean": 0.5})
        answer["tracker.example"] = "169.254.169.254"
        started.log(2, {"reward_mean": 0.75})
        state = mlflow.RequestHandlerClass.state
    [run] = state["runs"].values()
    assert run["metrics"] == [(1, "reward_mean", 0.5)]  # step 2 never reached any server
    [event] = events
    assert "failed at step 2" in event["message"] and "169.254.169.254, a non-public address" in event["message"]


def test_a_tenants_mlflow_server_gets_a_namespaced_run_and_no_operator_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "operator-token")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "operator")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "operator-password")
    with serving(_mlflow_handler()) as mlflow:
        settings = Settings(home=tmp_path, egress_allow=f"127.0.0.1:{_port(mlflow)}")
        integration = {"type": "mlflow", "mlflow": {"tracking_uri": base_url(mlflow), "experiment": "shared"}}
        for project, job in (("proj_alpha", "ftjob-a"), ("proj_beta", "ftjob-b")):
            started, events = _start([integration], settings, project_id=project, job_id=job)
            started.log(1, {"reward_mean": 1.0})
            started.finish("succeeded")
            assert events == []
        again, _ = _start([integration], settings, project_id="proj_beta", job_id="ftjob-b")  # a resumed run
        state = mlflow.RequestHandlerClass.state
    assert state["experiments"] == {"proj_alpha/shared": "1", "proj_beta/shared": "2"}
    by_job = {run["tags"]["cispo.job_id"]: run for run in state["runs"].values()}
    assert set(by_job) == {"ftjob-a", "ftjob-b"} and again.live["mlflow"].run_id == "run2"
    assert by_job["ftjob-b"]["experiment_id"] == "2" and by_job["ftjob-b"]["tags"]["cispo.project_id"] == "proj_beta"
    assert by_job["ftjob-b"]["status"] == "FINISHED" and by_job["ftjob-b"]["params"] == {"steps": "3"}
    assert not [headers for _, headers, _ in state["requests"] if "Authorization" in headers]


def test_projects_sharing_an_mlflow_file_store_log_to_their_own_experiments(tmp_path):
    pytest.importorskip("mlflow", reason="the tracking extra")
    from mlflow.tracking import MlflowClient

    store = f"file:{tmp_path / 'mlruns' / 'shared'}"
    settings = Settings(home=tmp_path, tracking_file_roots=str(tmp_path / "mlruns"))
    integration = {"type": "mlflow", "mlflow": {"tracking_uri": store, "experiment": "alpha-results"}}
    for project, job in (("proj_alpha", "ftjob-a"), ("proj_beta", "ftjob-b")):  # beta names alpha's experiment
        started, events = _start([integration], settings, project_id=project, job_id=job)
        started.log(1, {"reward_mean": 0.5})
        started.finish("succeeded")
        assert events == []
    client = MlflowClient(tracking_uri=store)
    assert client.get_experiment_by_name("alpha-results") is None
    for project, job in (("proj_alpha", "ftjob-a"), ("proj_beta", "ftjob-b")):
        experiment = client.get_experiment_by_name(f"{project}/alpha-results")
        [run] = client.search_runs([experiment.experiment_id])
        assert run.data.tags["cispo.job_id"] == job and run.data.tags["cispo.project_id"] == project


class _ChattyServerError(Exception):
    pass


def test_a_trackers_third_party_error_text_stays_in_the_worker_log(tmp_path, monkeypatch, caplog):
    """What a client library raises may quote a server's answer (W&B's CommError, MlflowException's 'Response
    body'): the event names the error's type only."""
    class Chatty:
        def __init__(self, *args):
            raise _ChattyServerError(f"API request failed. Response body: '{CREDENTIALS.decode()}'")

    monkeypatch.setitem(trackers.KINDS, "wandb", Chatty)
    started, events = _start([{"type": "wandb", "wandb": {"project": "p"}}], Settings(home=tmp_path))
    [event] = events
    assert "_ChattyServerError" in event["message"] and "worker's log" in event["message"]
    assert "SecretAccessKey" not in event["message"] and "Response body" not in event["message"]
    assert "SecretAccessKey" in caplog.text  # the operator still sees it


def test_a_wandb_entity_must_be_one_the_operator_lists_and_projects_are_namespaced(tmp_path, monkeypatch):
    settings = Settings(home=tmp_path, wandb_entities="team-alpha")
    _, events = _start([{"type": "wandb", "wandb": {"project": "p", "entity": "someone-else"}}], settings)
    [event] = events
    assert "'someone-else' is not a W&B entity this service logs to (team-alpha)" in event["message"]
    pytest.importorskip("wandb", reason="the tracking extra")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    started, events = _start([{"type": "wandb", "wandb": {"project": "p", "entity": "team-alpha"}}], settings,
                             project_id="proj_beta")
    try:
        assert events == [] and started.live["wandb"].run.project == "proj_beta-p"
    finally:
        started.finish("succeeded")
