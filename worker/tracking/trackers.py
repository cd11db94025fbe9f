"""Experiment trackers a job asked for (`integrations`: wandb, mlflow), fed by the job reporter.

Each step's metrics, the pre-flight's and every evaluation's go to every tracker, under the job's step. A tracker
is a convenience, never the job's truth (that is the metrics table): one that cannot start (its package missing
on this worker, a bad URI, a refused key) or that fails mid-run is switched off with an event saying so, and the
job goes on. A resumed run logs to the same tracker run (W&B: the run id is the job id; MLflow: the run tagged
with the job id), so a job is one run however many times its worker changed.

Each project logs into its own namespace of a shared store (service/tracking_targets.py). A tracking server the
tenant named is spoken to through the egress-checked client (worker/tracking/mlflow_rest.py), never MLflow's own, and an
event about a failing tracker carries only messages we wrote: a third party's exception text (a server's response
body among it) goes to the worker's log, not to the tenant.

The packages come with the `tracking` extra (pip install 'cispo-service[tracking]'); they load only when a job
asks for them.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable, Protocol
from urllib.parse import urlsplit

from service.egress import EgressPolicy
from service.schemas.integrations import Integration, MlflowSettings, WandbSettings
from service.settings import Settings
from service.tracking_targets import check_tracking_uri, check_wandb_entity, mlflow_experiment, wandb_project
from worker.tracking.mlflow_rest import MlflowRest, TrackingRequestFailed
from worker.tracking.tracker_location import location

log = logging.getLogger(__name__)

JOB_TAG = "cispo.job_id"
PROJECT_TAG = "cispo.project_id"
EXTRA = "pip install 'cispo-service[tracking]'"


class TrackerUnavailable(Exception):
    """The tracker cannot start here; the message says why and what to do."""


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def finish(self, status: str) -> None: ...


class WandbTracker:
    def __init__(self, cfg: WandbSettings, job_id: str, settings: Settings, config: dict, project_id: str):
        try:
            check_wandb_entity(cfg.entity, settings)  # checked at creation too; the operator's list may have changed
        except ValueError as e:
            raise TrackerUnavailable(str(e)) from None
        try:
            import wandb
        except ImportError:
            raise TrackerUnavailable(f"the wandb package is not installed on this worker ({EXTRA})") from None
        # An offline run (WANDB_MODE=offline) is a directory under WANDB_DIR; by default in the worker's home.
        where = Path(os.environ.get("WANDB_DIR") or settings.home / "wandb")
        where.mkdir(parents=True, exist_ok=True)
        # The server is the operator's (WANDB_BASE_URL, with the worker's key), never one a job names.
        self.run = wandb.init(project=wandb_project(project_id, cfg.project), entity=cfg.entity,
                              name=cfg.name or job_id, tags=cfg.tags, id=job_id, resume="allow", dir=str(where),
                              config=config, reinit="create_new", settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "succeeded" else 1)


class MlflowClientStore:
    """A file: store under the operator's roots, or the operator's own server (MLFLOW_TRACKING_URI), through
    MLflow's client: the same calls as MlflowRest."""

    def __init__(self, uri: str):
        try:
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise TrackerUnavailable(f"the mlflow package is not installed on this worker ({EXTRA})") from None
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless opted in; an operator who allows file: roots (checked before)
            # has opted in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.Metric, self.client = Metric, MlflowClient(tracking_uri=uri)

    def experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment else self.client.create_experiment(name)

    def find_run(self, experiment_id: str, tag: str, value: str) -> str | None:
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{tag}` = '{value}'", max_results=1)
        return found[0].info.run_id if found else None

    def create_run(self, experiment_id: str, name: str, tags: dict[str, str]) -> str:
        return self.client.create_run(experiment_id, run_name=name, tags=tags).info.run_id

    def log_params(self, run_id: str, params: dict[str, object]) -> None:
        for key, value in params.items():
            self.client.log_param(run_id, key, str(value)[:6000])

    def log_metrics(self, run_id: str, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[self.Metric(k, v, now, step) for k, v in metrics.items()])

    def terminate(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=status)

    def close(self) -> None:
        pass


class MlflowTracker:
    def __init__(self, cfg: MlflowSettings, job_id: str, settings: Settings, config: dict, project_id: str):
        uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise TrackerUnavailable("no tracking_uri was given and the worker has no MLFLOW_TRACKING_URI")
        if cfg.tracking_uri:  # checked at creation too; the operator's rules may have changed since
            try:
                check_tracking_uri(uri, settings)
            except ValueError as e:
                raise TrackerUnavailable(str(e)) from None
        if cfg.tracking_uri and urlsplit(uri).scheme in ("http", "https"):
            self.store = MlflowRest(uri, EgressPolicy.from_setting(settings.egress_allow))
        else:
            self.store = MlflowClientStore(uri)
        self.experiment = mlflow_experiment(project_id, cfg.experiment)  # the project's namespace
        experiment_id = self.store.experiment_id(self.experiment)
        self.run_id = self.store.find_run(experiment_id, JOB_TAG, job_id)
        if self.run_id is None:
            self.run_id = self.store.create_run(experiment_id, cfg.run_name or job_id,
                                                {**cfg.tags, JOB_TAG: job_id, PROJECT_TAG: project_id})
            self.store.log_params(self.run_id, config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.store.log_metrics(self.run_id, step, metrics)

    def finish(self, status: str) -> None:
        state = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}.get(status)
        try:
            if state is not None:  # paused or queued again: the run goes on at the next run of the job
                self.store.terminate(self.run_id, state)
        finally:
            self.store.close()


KINDS: dict[str, Callable[..., Tracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker}


class Trackers:
    """The job's live trackers; `event(message, level=...)` reports one that stops (the job's event stream)."""

    def __init__(self, integrations: list[Integration], job_id: str, settings: Settings, config: dict,
                 event: Callable[..., None], *, project_id: str):
        self.live: dict[str, Tracker] = {}
        self.event = event
        for integration in integrations:
            name = integration.type
            try:
                self.live[name] = KINDS[name](getattr(integration, name), job_id, settings, config, project_id)
            except Exception as e:  # noqa: BLE001 - any failure of a tracker only switches it off
                self._switch_off(name, "could not start", e)
            else:
                self._say_where(name, getattr(integration, name))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, tracker in list(self.live.items()):
            try:
                tracker.log(step, metrics)
            except Exception as e:  # noqa: BLE001
                self._switch_off(name, f"failed at step {step}", e)

    def finish(self, status: str) -> None:
        for name, tracker in list(self.live.items()):
            try:
                tracker.finish(status)
            except Exception as e:  # noqa: BLE001
                self._switch_off(name, "could not close its run", e)
        self.live.clear()

    def _say_where(self, name: str, cfg) -> None:
        """An info event naming where the run went (worker/tracking/tracker_location.py)."""
        try:
            where = location(name, self.live[name], cfg)
            if where:
                self.event(f"The {name} integration logs to {where}", level="info", data={"integration": name})
        except Exception:  # noqa: BLE001 - a courtesy, like the failure event
            log.warning("could not say where the %s run went", name, exc_info=True)

    def _switch_off(self, name: str, what: str, error: Exception) -> None:
        self.live.pop(name, None)
        log.warning("%s integration %s: %s: %s", name, what, type(error).__name__, error)
        if isinstance(error, (TrackerUnavailable, TrackingRequestFailed)):
            reason = str(error)  # our own words
        else:  # a client library's text may quote what a server answered
            reason = f"{type(error).__name__} (its message is in the worker's log, not shown here)"
        try:
            self.event(f"The {name} integration {what}: {reason[:500]}; the job goes on without it "
                       "(its metrics are in the job's metrics and result files)", level="error",
                       data={"integration": name})
        except Exception:  # noqa: BLE001 - the event is a courtesy; the database's trouble is the job's own
            log.warning("could not record the %s integration's failure", name, exc_info=True)
