"""Public API shapes: what clients send and what they get back (OpenAI-compatible where OpenAI has one).

Request models refuse unknown fields, so a typo is an error that names the
field instead of a setting silently ignored. Response models mirror OpenAI's
objects plus a few fields of ours (steps_done, total_steps, reward_function).
These are not the ORM models; service/api/presenters.py converts rows.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from service.schemas.json_text import lone_surrogate
from service.schemas.rewards import RewardSpec

T = TypeVar("T")


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


def refuse_import_reward(value: Any) -> Any:
    """The 'import' type runs any callable inside the worker, so only the trusted local CLI may use it."""
    if isinstance(value, dict) and value.get("type") == "import":
        raise ValueError(
            "reward type 'import' runs arbitrary code inside the worker and is only for local CLI runs; "
            "use 'python' (sandboxed), a builtin type (exact_match, contains, regex, numeric_match, json_valid, "
            "json_schema, length, similarity, string_check), http, score_model or multi"
        )
    return value


ServiceReward = Annotated[RewardSpec, BeforeValidator(refuse_import_reward)]


def _storable(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL (\\x00) characters")
    if problem := lone_surrogate(value):
        raise ValueError(problem)
    return value


Text = Annotated[str, AfterValidator(_storable)]
"""A string stored in a SQL text column: PostgreSQL cannot hold NUL, and no UTF-8 column a lone surrogate
(service/schemas/json_text.py), so both are refused here, by name."""


# -- files -------------------------------------------------------------------


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    sha256: str | None = Field(None, description="The content's SHA-256 (ours): GET /v1/files?sha256= finds an "
                               "uploaded copy of a local file")
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool = True


class ListObject(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


# -- reward functions --------------------------------------------------------


class RewardFunctionCreate(Request):
    name: Text = Field(min_length=1, max_length=200)
    spec: ServiceReward


class RewardFunctionObject(BaseModel):
    id: str
    object: Literal["reward_function"] = "reward_function"
    name: str
    type: str
    created_at: int
    spec: dict[str, Any]


# -- job events, checkpoints, metrics ----------------------------------------


class EventObject(BaseModel):
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    id: str
    created_at: int
    level: str
    message: str
    type: str
    data: dict[str, Any] | None = None


class CheckpointObject(BaseModel):
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    id: str
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    step_number: int
    metrics: dict[str, Any]
    eval: dict[str, Any] | None = Field(
        None, description="The eval at this step: mean reward over `n` rows with its 95% interval, and "
        "`difference_to_baseline` (paired, on the same rows as the step-0 eval) with its interval; "
        "eval_loss for a supervised job.")
    merged_model: bool = Field(False, description="A merged full-weight model is stored with it (training.export "
                               "'merged'): GET .../checkpoints/{id}/merged.")


class MetricPoint(BaseModel):
    step: int
    name: str
    value: float | None = Field(description="null when the stored value is not finite.")


class MetricList(BaseModel):
    object: Literal["list"] = "list"
    data: list[MetricPoint]
    has_more: bool


class SampleObject(BaseModel):
    """One of the few completions the worker keeps per step (texts cut to a few thousand characters)."""

    object: Literal["fine_tuning.job.sample"] = "fine_tuning.job.sample"
    id: str = Field(description="Stable within the job; pass it as `after` for the next page.")
    step: int
    prompt: str = Field(description="What the model saw, chat template applied.")
    completion: str = Field(description="The sampled text (an environment job: the episode after the prompt).")
    reward: float | None = Field(description="The sample's reward (null if not finite).")
    advantage: float | None = Field(description="Its group-relative advantage.")
    rewards: dict[str, float | None] = Field(
        description="Per component: a multi reward's parts (null where the part failed), an episode's turn rewards.")
    created_at: int


# -- jobs --------------------------------------------------------------------


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class JobHyperparameters(BaseModel):
    """OpenAI's summary, derived from the resolved spec."""

    batch_size: int
    learning_rate_multiplier: float = Field(description="optimizer.lr over the base learning rate, 1e-5 (so 1.0 "
                                            "is lr 1e-5, the default; 10 is 1e-4)")
    n_epochs: int | None = Field(description="passes over the training file, steps * batch_size / training rows "
                                 "rounded to a whole number (at least 1); null once the file is deleted")


class JobObject(BaseModel):
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    id: str
    model: str
    created_at: int
    finished_at: int | None
    fine_tuned_model: str | None
    organization_id: str
    result_files: list[str] = Field([], description="At the end: a metrics CSV (purpose fine-tune-results), "
                                    "downloadable with GET /v1/files/{id}/content.")
    status: str
    queue_position: int | None = Field(
        None, description="While queued: its place (1: next) in the queue workers take jobs from; with shared "
        "workers (CISPO_WORKER_JOBS > 1), among the queued jobs of its base model in fair-share order.")
    validation_file: str | None
    training_file: str
    trained_tokens: int | None
    error: JobError | None
    seed: int
    estimated_finish: int | None = Field(None, description="While running: Unix seconds, from the measured "
                                         "step rate.")
    integrations: list[dict[str, Any]] = []
    metadata: dict[str, str] | None
    user_provided_suffix: str | None
    hyperparameters: JobHyperparameters
    method: dict[str, Any]
    steps_done: int
    total_steps: int
    reward_function: str | None
    environment: str | None = None  # the registered environment's id (env-...), when the job uses one
    forecast: dict[str, Any] | None = Field(
        None, description="The worker's sigmoid fit of reward against trained tokens (refit as evals arrive): "
        "asymptote {mean, interval}, predicted_final_reward, estimated_finish, points, source (eval or "
        "train_reward), trustworthy and, when not, reason. Null until the job has trained.")
    best_checkpoint: str | None = Field(
        None, description="The kept checkpoint with the best eval (with training.keep_best: of the whole run).")


class DryRunCheck(BaseModel):
    name: Literal["model", "lengths", "reward_fields", "prompt_lengths", "engine", "quantization", "estimate", "cost"]
    status: Literal["passed", "warning", "skipped"] = Field(
        description="skipped: not checked, and the message says why (a failed check refuses the request).")
    message: str
    param: str | None = None


class DryRunObject(BaseModel):
    object: Literal["fine_tuning.job.dry_run"] = "fine_tuning.job.dry_run"
    spec: dict[str, Any]
    checks: list[DryRunCheck] = Field(description="What was checked and found, and what was not checked.")
    estimated_seconds: int | None = Field(description="From earlier jobs' step rate on this model; null without one.")
    expected_trained_tokens: int | None = Field(
        None, description="Tokens the update should train on (the cost check says how it was found; an upper "
        "bound without earlier jobs on the model); null for a supervised job.")
    expected_worker_seconds: int | None = Field(
        None, description="From this project's earlier succeeded jobs' seconds per trained token (on this model "
        "when any exist); null when there are none, as the cost check says.")


MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]
