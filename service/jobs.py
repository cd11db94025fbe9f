"""Fine-tuning jobs, service side: create (with idempotency), control, and project-scoped reads.

Nothing here commits or enqueues: the request boundary commits, and only
then sends the job id to the broker, so a worker never sees an id whose row
is not yet visible.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass

from sqlalchemy.orm import Session

from service.db.models import Checkpoint, File, Job
from service.job_spec.backend import check_backend
from service.errors import Conflict, InvalidRequest, NotFound, TooManyRequests, InvalidValue
from service.dry_run import check_reward_fields
from service.row_shapes import check_rows_fit_method
from service.environments import resolve_for_job
from service.job_spec.build import build_spec, grader_reward
from service.tracking_targets import check_tracking_uri, check_wandb_entity
from service.models import start as starts
from service.models.hub_cache import known_config, max_positions
from service.models.lengths import check_lengths, requested_sampling
from service.models.source import check_model
from service.repositories import files as files_repo
from service.repositories import jobs as jobs_repo
from service.repositories import reward_functions as rf_repo
from service.repositories.pagination import Page
from service.rewards.references import check_reward_references
from service.job_spec.request import JobCreate
from service.job_spec.spec import JobSpec
from service.settings import Settings
from service.storage import ObjectStore

IDEMPOTENCY_HEADER = "Idempotency-Key"


@dataclass
class Prepared:
    spec: JobSpec
    reward_function_id: str | None
    environment_id: str | None = None


def dataset_file(session: Session, project_id: str, file_id: str, param: str) -> File:
    file = files_repo.get(session, project_id, file_id)
    if file is None:
        raise InvalidRequest(f"{param}: no such file: {file_id}", param=param, code=f"invalid_{param}")
    if file.purpose != "fine-tune":
        raise InvalidRequest(f"{param}: file {file_id} has purpose {file.purpose!r}, not 'fine-tune'",
                             param=param, code=f"invalid_{param}")
    return file


def _registered_reward(session: Session, project_id: str, fn_id: str, method: str) -> tuple[dict, str]:
    """A registered reward function's spec and id, named by method.<method>.reward_function."""
    fn = rf_repo.get(session, project_id, fn_id)
    if fn is None:
        param = f"method.{method}.reward_function"
        raise InvalidRequest(f"{param}: no such reward function: {fn_id}", param=param)
    return fn.spec, fn.id


def prepare(session: Session, project_id: str, body: JobCreate, *, settings: Settings | None = None) -> Prepared:
    """Check every reference in the request and resolve the JobSpec (creates nothing)."""
    # A fine-tuned model or checkpoint of this project: its base model trains on from its weights.
    start = starts.resolve(session, project_id, body.model) if starts.names_a_start(body.model) else None
    if settings is not None:
        check_model(start.base_model if start else body.model, settings)
    training = dataset_file(session, project_id, body.training_file, "training_file")
    if body.validation_file is not None:
        dataset_file(session, project_id, body.validation_file, "validation_file")
    reward_function_id = environment_id = None
    environment = None
    if body.method.type == "cispo":
        cispo = body.method.cispo
        if cispo.environment is not None:
            reward = None
            environment, environment_id = resolve_for_job(session, project_id, cispo.environment,
                                                          param="method.cispo.environment", settings=settings)
        elif cispo.reward_function is not None:
            reward, reward_function_id = _registered_reward(session, project_id, cispo.reward_function, "cispo")
        else:
            reward = cispo.reward.model_dump(mode="json")
    elif body.method.type == "supervised":  # a reward is optional: it scores the evaluations
        sft = body.method.supervised
        reward = sft.reward.model_dump(mode="json") if sft.reward is not None else None
        if sft.reward_function is not None:
            reward, reward_function_id = _registered_reward(session, project_id, sft.reward_function, "supervised")
    else:
        reward = grader_reward(body.method.reinforcement.grader)
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    spec = build_spec(body, seed=seed, training_rows=training.rows, reward=reward, environment=environment,
                      start=start)
    if settings is not None:
        _check_integrations(spec, settings)
        check_backend(spec, settings, where=f"method.{body.method.type}.hyperparameters")
        _check_lengths(body, spec, start.base_model if start else body.model, settings)
    if spec.reward is not None:
        where = {"cispo": "method.cispo.reward_function" if reward_function_id else "method.cispo.reward",
                 "supervised": "method.supervised.reward_function" if reward_function_id
                 else "method.supervised.reward",
                 "reinforcement": "method.reinforcement.grader"}[body.method.type]
        check_reward_references(session, project_id, spec.reward, param=where, settings=settings)
    return Prepared(spec=spec, reward_function_id=reward_function_id, environment_id=environment_id)


def _check_lengths(body: JobCreate, spec: JobSpec, base_model: str, settings: Settings) -> None:
    explicit, param = requested_sampling(body)
    if explicit:
        check_lengths(spec.sampling, explicit, max_positions(known_config(base_model, settings)), param=param)


def _check_integrations(spec: JobSpec, settings: Settings) -> None:
    for i, integration in enumerate(spec.integrations):
        if integration.type == "mlflow" and integration.mlflow.tracking_uri is not None:
            param = f"integrations[{i}].mlflow.tracking_uri"
            try:
                check_tracking_uri(integration.mlflow.tracking_uri, settings)
            except ValueError as e:
                raise InvalidRequest(f"{param}: {e}", param=param) from None
        if integration.type == "wandb":
            param = f"integrations[{i}].wandb.entity"
            try:
                check_wandb_entity(integration.wandb.entity, settings)
            except ValueError as e:
                raise InvalidRequest(f"{param}: {e}", param=param) from None


def check_quota(session: Session, project_id: str, settings: Settings | None) -> None:
    """One more active job must fit in the project's quota (429: it frees up as jobs finish)."""
    if settings is None:
        return
    active = jobs_repo.active_count(session, project_id)
    if active >= settings.max_active_jobs:
        raise TooManyRequests(f"quota: this project has {active} queued or running jobs, its limit; wait for one "
                              "to finish or cancel one", retry_after_s=60, code="active_job_quota_exceeded")


def request_digest(body: JobCreate) -> str:
    """What the client sent, canonically: same key + same digest is a replay."""
    canonical = json.dumps(body.model_dump(mode="json", exclude_unset=True), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def replay(session: Session, project_id: str, key: str, digest: str) -> Job | None:
    """The job an earlier request with this Idempotency-Key created, if any."""
    job = jobs_repo.find_by_idempotency_key(session, project_id, key)
    if job is not None and job.request_sha256 != digest:
        raise InvalidValue(f"{IDEMPOTENCY_HEADER}: this key was already used with a different request body; "
                           "use a new key for a new job", param=IDEMPOTENCY_HEADER, code="idempotency_key_reused")
    return job


def create(session: Session, project_id: str, body: JobCreate, *, idempotency_key: str | None,
           settings: Settings | None = None, store: ObjectStore | None = None) -> tuple[Job, bool]:
    """(job, created): an idempotent replay returns the earlier job and created=False. With `store`, the rows of
    both files are checked for the fields the reward reads."""
    digest = request_digest(body)
    if idempotency_key and (earlier := replay(session, project_id, idempotency_key, digest)):
        return earlier, False
    prepared = prepare(session, project_id, body, settings=settings)
    if store is not None:
        check_rows_fit_method(session, store, project_id, prepared.spec)
        check_reward_fields(session, store, project_id, body, prepared.spec)
    check_quota(session, project_id, settings)
    spec = prepared.spec
    job = jobs_repo.add(session, Job(
        project_id=project_id, status="queued", model=body.model, training_file=body.training_file,
        validation_file=body.validation_file, reward_function_id=prepared.reward_function_id,
        environment_id=prepared.environment_id,
        spec=spec.model_dump(mode="json"), method=body.method.model_dump(mode="json", exclude_unset=True),
        seed=spec.seed, suffix=body.suffix, metadata_=body.metadata, idempotency_key=idempotency_key,
        request_sha256=digest if idempotency_key else None, total_steps=spec.training.steps,
    ))
    jobs_repo.add_event(session, job.id, "Job created")
    return job, True


# -- reads -------------------------------------------------------------------


def get(session: Session, project_id: str, job_id: str) -> Job:
    job = jobs_repo.get(session, project_id, job_id)
    if job is None:
        raise NotFound(f"no such fine-tuning job: {job_id}", param="fine_tuning_job_id")
    return job


def list_jobs(session: Session, project_id: str, *, after: str | None, limit: int,
              metadata: dict[str, str]) -> Page[Job]:
    return jobs_repo.page(session, project_id, after=after, limit=limit, metadata=metadata)


def training_rows(session: Session, project_id: str, jobs: list[Job]) -> dict[str, int]:
    return files_repo.rows_by_id(session, project_id, [j.training_file for j in jobs])


def checkpoint(session: Session, project_id: str, job_id: str, checkpoint_id: str) -> tuple[Job, Checkpoint]:
    job = get(session, project_id, job_id)
    ckpt = jobs_repo.checkpoint(session, job.id, checkpoint_id)
    if ckpt is None:
        raise NotFound(f"no such checkpoint: {checkpoint_id}", param="checkpoint_id")
    return job, ckpt


# -- control -----------------------------------------------------------------

_TRANSITIONS = {"cancel": jobs_repo.request_cancel, "pause": jobs_repo.request_pause, "resume": jobs_repo.resume}


def control(session: Session, project_id: str, job_id: str, action: str, *,
            settings: Settings | None = None) -> Job:
    """cancel / pause / resume; an illegal change is a Conflict the client should not retry."""
    job = get(session, project_id, job_id)
    if action == "resume" and job.status == "paused":
        check_quota(session, project_id, settings)
    try:
        return _TRANSITIONS[action](session, job)
    except jobs_repo.IllegalTransition as e:
        raise Conflict(str(e), code="invalid_job_state") from None
