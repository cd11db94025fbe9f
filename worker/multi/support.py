"""Which jobs can share a resident base, and why not when they cannot (a job that cannot waits for a worker of
its own rather than failing)."""

from __future__ import annotations

from service.job_spec.spec import JobSpec


def refusal(spec: JobSpec) -> str | None:
    """Why `spec` cannot train beside other jobs on a shared base, or None when it can.

    Full fine-tuning cannot: every weight is the job's own, so there is no base to share. Nor several GPUs: a
    shared base is one process on one device, while such a job's torchrun ranks each hold an FSDP2 shard of its
    model (a shared worker would have to run every resident job that way itself). A quantised base is not done
    yet. Asynchronous sampling (rollout.max_staleness > 0) shares: the job samples with a stale copy of its
    adapter (worker/multi/job.py); so does its own rollout.dtype: its rows decode on copies of the base's weights
    cast to it, as alone (worker/multi/rollout.py). A job of another base, dtype or rollout.dtype shares another
    worker's (base_key)."""
    reasons = []
    if spec.lora is None:
        reasons.append("it fine-tunes every weight (lora: null)")
    elif spec.lora.base_quantization != "none":
        reasons.append("its base is quantised")
    if spec.resources.gpus > 1:
        reasons.append("it runs on several GPUs")
    return "; ".join(reasons) or None


def base_key(spec: JobSpec) -> tuple[str, str, str]:
    """What jobs must agree on to share one resident base: the model, the precision it is held in and the one its
    jobs sample in (rollout.dtype; 'auto' where it is the training dtype), so that a worker's decode is one batch
    on one set of weights (worker/multi/rollout.py decodes each sampling precision apart)."""
    rollout = spec.rollout.dtype if spec.rollout.dtype != spec.dtype else "auto"
    return spec.model, spec.dtype, rollout
