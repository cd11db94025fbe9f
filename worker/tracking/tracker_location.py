"""Where a job's tracker run went, in words for its event stream: the W&B run's URL (or its offline directory),
the MLflow experiment and run id, with the job's tracking URI (never credentials) and how to read a file store.

Only what the job itself named is shown: a run logged to the worker's own MLFLOW_TRACKING_URI says so without
printing the operator's URI.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def without_credentials(uri: str) -> str:
    parts = urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def wandb_location(run) -> str:
    url = getattr(run, "url", None)
    if url:
        return f"W&B run {run.id}: {url}"
    return (f"W&B run {run.id}, offline on the worker in {getattr(run, 'dir', None) or 'WANDB_DIR'} "
            "(`wandb sync` uploads it)")


def mlflow_location(run_id: str, experiment: str, tracking_uri: str | None) -> str:
    text = f"MLflow run {run_id} in experiment {experiment!r}"
    if tracking_uri is None:
        return text + " on the worker's MLFLOW_TRACKING_URI"
    shown = without_credentials(tracking_uri)
    if shown.startswith("file:"):
        # MLflow 3 opens a file store only when opted in.
        return text + (f" at {shown} (read it with MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri "
                       f"{shown})")
    return text + f" at {shown}"


def location(name: str, tracker, cfg) -> str | None:
    """The sentence for a started tracker of kind `name`, or None for a kind this module does not know."""
    if name == "wandb":
        return wandb_location(tracker.run)
    if name == "mlflow":
        return mlflow_location(tracker.run_id, tracker.experiment, cfg.tracking_uri)
    return None
