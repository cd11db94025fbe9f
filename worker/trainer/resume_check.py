"""Which spec changes a resumed run refuses: the checkpoint's spec against the job's spec now."""

from __future__ import annotations

from pydantic import ValidationError

from service.job_spec.spec import JobSpec

# Spec sections that may change between a run and its resumption.
RESUMABLE_CHANGES = {"steps", "eval_interval", "eval_max_rows", "checkpoint_interval", "preflight_groups",
                     "no_signal_steps", "fail_on_no_signal"}


def resume_mismatch(saved: dict, spec: JobSpec) -> list[str]:
    now = spec.model_dump(mode="json")
    try:  # fields added to the spec since the checkpoint, at their defaults, are not changes
        saved = JobSpec.model_validate(saved).model_dump(mode="json")
    except ValidationError:
        pass
    # Dataset files may live at another path on another worker; what they hold is the job's. So may the
    # starting checkpoint, which a resumed run no longer reads (the reference it pinned is in the checkpoint).
    now["data"] = {**now["data"], "train_file": None, "validation_file": None}
    saved = {**saved, "data": {**saved.get("data", {}), "train_file": None, "validation_file": None}}
    now["init_from"] = saved["init_from"] = None
    # A checkpoint holds whole tensors, so the number of processes may change too.
    diffs = [k for k in now if k not in ("training", "resources") and now[k] != saved.get(k)]
    diffs += [
        f"training.{k}"
        for k in now["training"]
        if k not in RESUMABLE_CHANGES and now["training"][k] != saved.get("training", {}).get(k)
    ]
    return diffs
