"""Which jobs can share a resident base, and why not when they cannot (a job that cannot waits for a worker of
its own rather than failing)."""

from __future__ import annotations

from service.job_spec.spec import JobSpec


def refusal(spec: JobSpec) -> str | None:
    """Why `spec` cannot train beside other jobs on a shared base, or None when it can.

    Full fine-tuning cannot: every weight is the job's own, so there is no base to share. Nor several GPUs: a
    shared base is one process on one device, while such a job's torchrun ranks each hold an FSDP2 shard of its
    model (a shared worker would have to run every resident job that way itself). A quantised base and its own
    rollout.dtype are not done yet. Asynchronous sampling (rollout.max_staleness > 0) shares: the job samples
    with a stale copy of its adapter (worker/multi/job.py). A job of another base or dtype shares another
    worker's (base_key)."""
    reasons = []
    if spec.lora is None:
        reasons.append("it fine-tunes every weight (lora: null)")
    elif spec.lora.base_quantization != "none":
        reasons.append("its base is quantised")
    if spec.rollout.dtype != "auto":
        reasons.append("it samples in its own rollout.dtype")
    if spec.resources.gpus > 1:
        reasons.append("it runs on several GPUs")
    return "; ".join(reasons) or None


def base_key(spec: JobSpec) -> tuple[str, str]:
    """What jobs must agree on to share one resident base: the model and the precision it is held in."""
    return spec.model, spec.dtype
