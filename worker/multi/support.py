"""Which jobs can share a resident base, and why not when they cannot (a job that cannot waits for a worker of
its own rather than failing)."""

from __future__ import annotations

from service.job_spec.spec import JobSpec


def refusal(spec: JobSpec) -> str | None:
    """Why `spec` cannot train beside other jobs on a shared base, or None when it can."""
    reasons = []
    if spec.method != "cispo":
        reasons.append("it is a supervised job")
    if spec.lora is None:
        reasons.append("it fine-tunes every weight (lora: null)")
    elif spec.lora.base_quantization != "none":
        reasons.append("its base is quantised")
    if spec.rollout.dtype != "auto":
        reasons.append("it samples in its own rollout.dtype")
    if spec.rollout.max_staleness:
        reasons.append("it samples asynchronously (rollout.max_staleness > 0)")
    if spec.resources.gpus > 1:
        reasons.append("it runs on several GPUs")
    return "; ".join(reasons) or None


def base_key(spec: JobSpec) -> tuple[str, str]:
    """What jobs must agree on to share one resident base: the model and the precision it is held in."""
    return spec.model, spec.dtype
