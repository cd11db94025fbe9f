"""The event that says where a job's tracker run went (worker/tracking/tracker_location.py, worker/tracking/trackers.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from service.schemas.integrations import Integration
from service.settings import Settings
from worker.tracking.tracker_location import mlflow_location, wandb_location
from worker.tracking.trackers import Trackers


def test_the_location_names_the_run_and_never_credentials_or_the_operators_uri():
    remote = mlflow_location("abc", "cispo", "https://user:pw@mlflow.example.com:5000/")
    assert remote == "MLflow run abc in experiment 'cispo' at https://mlflow.example.com:5000/"
    default = mlflow_location("abc", "cispo", None)
    assert default.endswith("on the worker's MLFLOW_TRACKING_URI") and "://" not in default
    assert "MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri file:/srv/t" in mlflow_location(
        "abc", "cispo", "file:/srv/t")
    assert wandb_location(SimpleNamespace(id="ftjob-1", url="https://wandb.ai/t/p/runs/ftjob-1")) == \
        "W&B run ftjob-1: https://wandb.ai/t/p/runs/ftjob-1"
    assert "offline on the worker in /w/run" in wandb_location(SimpleNamespace(id="ftjob-1", url=None, dir="/w/run"))


def test_a_started_mlflow_run_is_an_info_event_naming_it(tmp_path):
    pytest.importorskip("mlflow", reason="the tracking extra")
    store = tmp_path / "mlruns"
    settings = Settings(home=tmp_path / "home", tracking_file_roots=str(tmp_path))
    integration = Integration.model_validate({"type": "mlflow", "mlflow": {"tracking_uri": f"file:{store}",
                                                                          "experiment": "exp"}})
    events = []
    trackers = Trackers([integration], "ftjob-where", settings, {}, lambda message, **kw: events.append((message, kw)),
                        project_id="proj-a")
    try:
        run_id = trackers.live["mlflow"].run_id
    finally:
        trackers.finish("succeeded")
    [(message, kw)] = events
    assert message == (f"The mlflow integration logs to MLflow run {run_id} in experiment 'proj-a/exp' at file:{store} "
                       f"(read it with MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri file:{store})")
    assert kw == {"level": "info", "data": {"integration": "mlflow"}}
