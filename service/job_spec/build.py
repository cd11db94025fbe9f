"""Turn a job request into the JobSpec the worker runs (pure: no database, no I/O).

Two request shapes lead here. `cispo` passes JobSpec sections through as they
are. `reinforcement` is OpenAI's RFT shape, mapped onto CISPO:

    grader (string_check, text_similarity, python, score_model, multi)
                             -> reward (service/schemas/graders.py)
    batch_size               -> training.batch_size
    n_epochs ("auto" = 1)    -> training.steps = ceil(n_epochs * training rows / batch_size)
    learning_rate_multiplier -> optimizer.lr = 1e-5 * multiplier
    eval_interval            -> training.eval_interval
    eval_samples             -> training.eval_max_rows
    compute_multiplier       -> training.group_size = max(2, round(8 * multiplier))

JobSpec.model_validate then applies every bound, and its errors are reported
under the request field the client wrote, not the spec's internal name.
"""

from __future__ import annotations

import math

from pydantic import ValidationError

from service.errors import InvalidRequest, InvalidValue, invalid_value
from service.models.start import Start
from service.schemas import graders
from service.job_spec.request import JobCreate, ReinforcementMethod
from service.job_spec.spec import JobSpec, LoraSpec, TrainingSpec

BASE_LR = 1e-5
DEFAULT_MINI_BATCHES = TrainingSpec.model_fields["mini_batches"].default
GRADER = "method.reinforcement.grader"
RFT_HP = "method.reinforcement.hyperparameters"
SFT_HP = "method.supervised.hyperparameters"

# Where each spec field came from in a reinforcement request.
_RFT_SOURCES = {
    "training.batch_size": f"{RFT_HP}.batch_size",
    "training.steps": f"{RFT_HP}.n_epochs",
    "training.eval_interval": f"{RFT_HP}.eval_interval",
    "training.eval_max_rows": f"{RFT_HP}.eval_samples",
    "training.group_size": f"{RFT_HP}.compute_multiplier",
    "training": RFT_HP,
    "optimizer.lr": f"{RFT_HP}.learning_rate_multiplier",
    "optimizer": RFT_HP,
    "reward": GRADER,
}


def grader_reward(grader: dict) -> dict:
    """The reward spec an OpenAI grader means (service/schemas/graders.py); errors name the grader's fields."""
    return graders.grader_reward(grader, param=GRADER)


def _reinforcement_sections(method: ReinforcementMethod, training_rows: int) -> dict:
    hp = method.hyperparameters
    training: dict = {}
    batch = TrainingSpec.model_fields["batch_size"].default if hp.batch_size == "auto" else hp.batch_size
    training["batch_size"] = batch
    epochs = 1 if hp.n_epochs == "auto" else hp.n_epochs
    training["steps"] = max(1, math.ceil(epochs * training_rows / batch))
    if hp.eval_interval != "auto":
        training["eval_interval"] = hp.eval_interval
    if hp.eval_samples != "auto":
        training["eval_max_rows"] = hp.eval_samples
    group = 8 if hp.compute_multiplier == "auto" else max(2, round(8 * hp.compute_multiplier))
    training["group_size"] = group
    # Small batches hold fewer sequences than the default number of mini-batches.
    training["mini_batches"] = min(DEFAULT_MINI_BATCHES, batch * group)
    sections: dict = {"training": training}
    if hp.learning_rate_multiplier != "auto":
        sections["optimizer"] = {"lr": BASE_LR * hp.learning_rate_multiplier}
    return sections


def _supervised_sections(hp, training_rows: int) -> dict:
    """OpenAI's SFT hyperparameters over our training section: one optimizer step per batch of rows."""
    training = hp.training.model_dump() if hp.training is not None else {}
    batch = min(8, training_rows) if hp.batch_size == "auto" else hp.batch_size
    epochs = 3 if hp.n_epochs == "auto" else hp.n_epochs  # OpenAI's usual choice for small files
    training |= {"batch_size": batch, "steps": max(1, math.ceil(epochs * training_rows / batch)),
                 "mini_batches": 1, "preflight_groups": 0}
    sections: dict = {"method": "supervised", "training": training}
    if hp.learning_rate_multiplier != "auto":
        sections["optimizer"] = {"lr": BASE_LR * hp.learning_rate_multiplier}
    if hp.dtype is not None:
        sections["dtype"] = hp.dtype
    if hp.sampling is not None:
        sections["sampling"] = hp.sampling.model_dump()
    if "lora" in hp.model_fields_set:
        sections["lora"] = None if hp.lora is None else hp.lora.model_dump()
    return sections


def _request_path(method_type: str, spec_path: str) -> str:
    if spec_path == "data.train_file":
        return "training_file"
    if spec_path == "data.validation_file":
        return "validation_file"
    if spec_path in ("model", "seed") or spec_path.split(".")[0] == "integrations":
        return spec_path
    if spec_path == "init_from":  # set from a fine-tuned model or checkpoint named as the model
        return "model"
    if method_type == "supervised":
        head = spec_path.split(".")[0]
        if head == "reward":
            return "method.supervised." + spec_path
        if spec_path in ("training.batch_size", "training.steps"):
            return f"{SFT_HP}.batch_size" if spec_path.endswith("batch_size") else f"{SFT_HP}.n_epochs"
        if spec_path.startswith("optimizer"):
            return f"{SFT_HP}.learning_rate_multiplier"
        return f"{SFT_HP}.{spec_path}" if head in ("training", "lora", "dtype", "sampling") else "method.supervised"
    if method_type == "reinforcement":
        for prefix in sorted(_RFT_SOURCES, key=len, reverse=True):
            if spec_path == prefix or spec_path.startswith(prefix + "."):
                return _RFT_SOURCES[prefix]
        return RFT_HP
    if spec_path.split(".")[0] in ("reward", "environment"):
        return "method.cispo." + spec_path
    if not spec_path:  # a rule across sections (e.g. reward vs environment); the message names the fields
        return "method.cispo"
    return "method.cispo.hyperparameters." + spec_path


def _start_sections(sections: dict, start: Start, method_type: str) -> dict:
    """A continued job trains the starting checkpoint's weights: the same adapter shape (or none) as its job."""
    if "lora" not in sections:
        return {**sections, "lora": start.lora}
    given = None if sections["lora"] is None else LoraSpec.model_validate(sections["lora"]).model_dump(mode="json")
    if given != start.lora:
        param = {"cispo": "method.cispo.hyperparameters.lora",
                 "supervised": f"{SFT_HP}.lora"}.get(method_type, "model")
        raise InvalidRequest(f"{param}: the starting checkpoint (job {start.source_job_id}) holds "
                             f"{'a whole model' if start.lora is None else 'the adapter ' + str(start.lora)}; "
                             "leave lora out to train it on, or give exactly that", param=param)
    return sections


def build_spec(body: JobCreate, *, seed: int, training_rows: int, reward: dict | None,
               environment: dict | None = None, start: Start | None = None) -> JobSpec:
    """The resolved spec; `reward` is the reward spec (inline, registered, or mapped from a grader), or
    `environment` the environment spec (inline or registered); `start` the checkpoint a continued job
    starts from (its base model trains on, its weights pinned as the reference: spec.init_from)."""
    method = body.method
    if method.type == "cispo":
        hp = method.cispo.hyperparameters
        # A section left out takes the JobSpec default; an explicit `"lora": null` asks for full fine-tuning.
        sections = {name: value.model_dump() if hasattr(value, "model_dump") else value
                    for name in type(hp).model_fields
                    if (value := getattr(hp, name)) is not None or (name == "lora" and name in hp.model_fields_set)}
    elif method.type == "supervised":
        sections = _supervised_sections(method.supervised.hyperparameters, training_rows)
    else:
        sections = _reinforcement_sections(method.reinforcement, training_rows)
    if start is not None:
        sections = {**_start_sections(sections, start, method.type), "init_from": start.checkpoint_id}
    data = {
        "model": start.base_model if start is not None else body.model,
        "seed": seed,
        "data": {"train_file": body.training_file, "validation_file": body.validation_file},
        **({"reward": reward} if reward is not None else {}),
        **({"environment": environment} if environment is not None else {}),
        **({"integrations": [i.model_dump(mode="json") for i in body.integrations]} if body.integrations else {}),
        **sections,
    }
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        raise invalid_value(e, data, path=lambda p: _request_path(method.type, p)) from None
    # Pydantic lets NaN and infinity through bounds such as ge=0; neither JSON columns nor the trainer can use them.
    if (where := _non_finite(spec.model_dump())) is not None:
        param = _request_path(method.type, where)
        raise InvalidValue(f"{param}: must be a finite number", param=param)
    return spec


def _non_finite(value, path: str = "") -> str | None:
    """The dotted path of the first NaN or infinity in a dumped spec, if any."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        sub = f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]"
        if (found := _non_finite(item, sub.lstrip("."))) is not None:
            return found
    return None


def public_hyperparameters(spec: dict, training_rows: int | None) -> dict:
    """OpenAI's hyperparameters summary of a stored spec (n_epochs is None once the file is gone)."""
    training = spec.get("training", {})
    steps, batch = training.get("steps", 0), training.get("batch_size", 1)
    # A whole number, as OpenAI's SDK types it (its model_dump warns on 1.2): the passes over the file, rounded
    # half up, at least 1; n_epochs 3 of 5 rows in batches of 2 is 8 steps (3.2 passes), reported as 3.
    epochs = max(1, math.floor(steps * batch / training_rows + 0.5)) if training_rows else None
    return {
        "batch_size": batch,
        "learning_rate_multiplier": round(spec.get("optimizer", {}).get("lr", BASE_LR) / BASE_LR, 8),
        "n_epochs": epochs,
    }
