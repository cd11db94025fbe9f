"""Where a job's trackers may log: checked by the API when the job is created and by the worker before it
connects (service/schemas/integrations.py). A tracking URI is user input the worker acts on, so it gets the
same rules as remote rewards: an http(s) server must pass the egress policy (no loopback or private address
unless the operator allow-lists it; the worker checks every request again, worker/tracking/mlflow_rest.py), and a file:
store must lie under a directory the operator names in CISPO_TRACKING_FILE_ROOTS (else a job could write into
the worker's own files).

Stores are shared by every project that can reach them (the operator's MLflow server or file root, the W&B
account of the worker's key), so each project logs into its own namespace: MLflow experiments are named
`<project id>/<experiment>` and W&B projects `<project id>-<project>`, and a W&B entity must be one the operator
lists in CISPO_WANDB_ENTITIES."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from service.egress import EgressPolicy, EgressRefused, check_url
from service.settings import Settings


def mlflow_experiment(project_id: str, experiment: str) -> str:
    return f"{project_id}/{experiment}"


def wandb_project(project_id: str, project: str) -> str:
    return f"{project_id}-{project}"  # W&B project names may not hold '/'


def check_wandb_entity(entity: str | None, settings: Settings) -> None:
    """Raises ValueError unless the job may log to `entity` (None: the worker key's default entity)."""
    allowed = settings.resolved_wandb_entities()
    if entity is not None and entity not in allowed:
        where = ", ".join(allowed) or "none: leave entity out, runs go to the worker key's default entity"
        raise ValueError(f"{entity!r} is not a W&B entity this service logs to ({where})")


def check_tracking_uri(uri: str, settings: Settings) -> None:
    """Raises ValueError saying why the worker may not log to `uri`."""
    parts = urlsplit(uri)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{uri!r}: a file: URI names a local path (file:/dir or file:///dir), not a host")
        path = Path(unquote(parts.path)).resolve()
        roots = settings.resolved_tracking_file_roots()
        if not any(path == root or root in path.parents for root in roots):
            where = ", ".join(map(str, roots)) or "none: CISPO_TRACKING_FILE_ROOTS is empty"
            raise ValueError(f"{uri!r}: a file: store must lie under a directory the operator allows ({where})")
        return
    try:
        check_url(uri, EgressPolicy.from_setting(settings.egress_allow))
    except EgressRefused as e:
        raise ValueError(str(e)) from None
