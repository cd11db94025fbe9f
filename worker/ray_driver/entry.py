"""The one door into Ray for the job runner and `cispo train` (imports Ray only past the deployment check)."""

from __future__ import annotations

from pathlib import Path

from service.job_spec.backend import ray_installed, ray_refusal
from service.job_spec.spec import JobSpec
from service.settings import Settings
from worker.rewards.engine import ScoringContext


def run_on_ray_cluster(spec: JobSpec, run_dir: Path, callbacks, *, settings: Settings,
                       scoring: ScoringContext | None = None, resume: bool = True):
    """Train a job with spec.resources.on_ray on the cluster at settings.ray_address; returns its TrainResult.
    A deployment without the cluster or the `ray` package fails it at once (a ValueError naming the field:
    invalid_job, no retry), the twin of the check at create."""
    refusal = ray_refusal(spec, settings, installed=ray_installed())
    if refusal is not None:
        raise ValueError(f"{refusal[0]}: {refusal[1]}")
    from worker.ray_driver.driver import run_on_ray

    return run_on_ray(spec, run_dir, callbacks, settings=settings, scoring=scoring, resume=resume,
                      job_name=getattr(callbacks, "job_id", "job"))
