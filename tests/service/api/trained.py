"""A job that has trained, written the way a worker writes it (through the repositories, under a lease):
metrics per step, events, a checkpoint whose adapter tar is in the object store, then a final status."""

from __future__ import annotations

import io
import tarfile

from service.db.session import session_factory
from service.repositories import job_outputs
from service.repositories import job_lease, job_records, jobs as jobs_repo

# Per step: the curves the dashboard draws (names as worker/trainer/loop.py and metrics.py write them).
CURVES = {
    "reward_mean": [0.1, 0.35, 0.6],
    "kl_old": [0.0, 0.02, 0.05],
    "clip_fraction": [0.0, 0.125, 0.25],
    "loss": [0.5, 0.25, -0.1],
}


def adapter_tar(payload: bytes = b"lora weights") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("adapter/adapter_model.safetensors")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


def train(database_url: str, store, job_id: str, *, status: str | None = "succeeded",
          steps: int = 3, checkpoint_step: int | None = 3, samples: dict[int, list[dict]] | None = None,
          tar: bytes | None = None, checkpoint_metrics: dict[str, float] | None = None) -> dict:
    """Run the job's records through `steps` steps (with `samples` per step, if given); returns the lease
    epoch and the checkpoint's id, sha256, tar bytes (`tar`, or a one-file adapter) and storage prefix."""
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        epoch = job_lease.claim(s, job_id, "test-worker", ttl_s=600)
        assert epoch is not None
        jobs_repo.add_event(s, job_id, "Training started")
    for step in range(1, steps + 1):
        with sessions.begin() as s:
            values = {name: series[(step - 1) % len(series)] for name, series in CURVES.items()}
            assert job_records.record_step(s, job_id, epoch, step, values, trained_tokens=10, ttl_s=600)
            jobs_repo.add_event(s, job_id, f"Step {step}: reward {values['reward_mean']}", type="metrics",
                                data={"step": step, **values})
            if samples and step in samples:
                assert job_outputs.add_samples(s, job_id, epoch, step, samples[step])
    out: dict = {"epoch": epoch}
    if checkpoint_step:
        tar = tar or adapter_tar()
        prefix = f"jobs/{job_id}/checkpoints/step-{checkpoint_step}"
        sha = store.put_bytes(f"{prefix}/adapter.tar", tar)
        with sessions.begin() as s:
            ckpt = job_records.add_checkpoint(s, job_id, epoch, step=checkpoint_step, storage_prefix=prefix,
                                              files={"adapter.tar": {"sha256": sha, "bytes": len(tar)}},
                                              metrics=checkpoint_metrics or {"reward_mean": CURVES["reward_mean"][-1]})
            jobs_repo.add_event(s, job_id, f"Checkpoint saved at step {checkpoint_step}")
            out.update(checkpoint=ckpt.id, sha256=sha, tar=tar, prefix=prefix)
    if status:
        with sessions.begin() as s:
            assert job_lease.finish(s, job_id, epoch, status)
            jobs_repo.add_event(s, job_id, f"Job {status}")
    return out
