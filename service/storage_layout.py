"""Where a job's checkpoints live in the object store, and what a stored checkpoint holds: the one definition
shared by the worker, which writes them (worker/checkpoints/artifacts.py, worker/model/export.py, worker/jobs/job_runner.py), and the
API, which serves them (service/api/routes/job_outputs.py).

    jobs/<job id>/checkpoints/epoch-<lease epoch, 6 digits>/<checkpoint dir>/
        <every file the manifest lists>      adapter/..., model/..., trainer_state.*
        adapter.tar                          ARCHIVE: the whole checkpoint in one reproducible tar
        merged/<file>, merged/manifest.json  a merged export (MERGED_DIR), when the job asked for one
        merged.tar                           MERGED_ARCHIVE: that export in one tar
        manifest.json                        MANIFEST: stored last, so its presence means a complete upload

Every run (lease epoch) writes under its own prefix, so a stale worker never uploads over a committed checkpoint.
"""

from __future__ import annotations

MANIFEST = "manifest.json"
ARCHIVE = "adapter.tar"
MERGED_DIR = "merged"
MERGED_ARCHIVE = "merged.tar"
# The stored paths GET .../checkpoints/{id}/files/{path} serves besides MANIFEST: the weights, not trainer state.
SERVED_DIRS = ("adapter/", f"{MERGED_DIR}/")


def job_checkpoints(job_id: str) -> str:
    """Every checkpoint of a job, of all its runs."""
    return f"jobs/{job_id}/checkpoints"


def run_checkpoints(job_id: str, epoch: int) -> str:
    """The checkpoints one run (lease epoch) of a job uploads."""
    return f"{job_checkpoints(job_id)}/epoch-{epoch:06d}"


def checkpoint_prefix(job_id: str, epoch: int, name: str) -> str:
    """One checkpoint's prefix: its run's, then the checkpoint directory's name (step-00000010)."""
    return f"{run_checkpoints(job_id, epoch)}/{name}"


def tinker_checkpoint(project_id: str, model_id: str, kind: str, name: str) -> str:
    """A Tinker training client's saved state ("weights") or sampler weights, stored as a job's checkpoint is
    (manifest last), under its project: tinker/<project>/<model id>/<kind>/<name>."""
    for part, value in (("model id", model_id), ("name", name)):
        if not value or "/" in value or value in (".", ".."):
            raise ValueError(f"{part} {value!r} cannot name a stored checkpoint (no '/', not empty)")
    return f"tinker/{project_id}/{model_id}/{kind}/{name}"


# How many '/'-separated parts a checkpoint's prefix has: jobs/<id>/checkpoints/epoch-N/<name>.
CHECKPOINT_PREFIX_DEPTH = len(checkpoint_prefix("j", 0, "s").split("/"))
