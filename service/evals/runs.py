"""Eval runs, service side: check the request, resolve what runs, queue it; the model never runs here.

What runs is a JobSpec for the worker's eval harness (worker/jobs/eval_runner.py): the base model, the
starting checkpoint (`init_from`, a checkpoint id) for a fine-tuned model, the file as its rows, and the
reward. A fine-tuned model or checkpoint takes its job's adapter shape, precision and sampling, and its
job's reward when the request names none. A base model must be one the project may run as it is
(service/models/known_bases.py); a project has at most `max_active_evals` runs queued or running.
"""

from __future__ import annotations

from pydantic import ValidationError
from sqlalchemy.orm import Session

from service.db.models import EvalRun, Job
from service.errors import Conflict, InvalidRequest, NotFound, TooManyRequests, invalid_value
from service.jobs import dataset_file
from service.models import start as starts
from service.models.hub_cache import known_config, max_positions
from service.models.known_bases import check_known_base
from service.models.lengths import check_lengths
from service.repositories import evals as evals_repo
from service.repositories import jobs as jobs_repo
from service.repositories import reward_functions as rf_repo
from service.repositories.pagination import Page
from service.rewards.references import check_reward_references
from service.row_shapes import check_rows_fit_method
from service.evals.request import EvalCreate
from service.job_spec.spec import JobSpec
from service.settings import Settings
from service.storage import ObjectStore


def _reward(session: Session, project_id: str, body: EvalCreate, source: Job | None) -> tuple[dict, str | None, str]:
    """(reward spec, registered id or None, the request field it came from)."""
    if body.reward is not None:
        return body.reward.model_dump(mode="json"), None, "reward"
    if body.reward_function is not None:
        fn = rf_repo.get(session, project_id, body.reward_function)
        if fn is None:
            raise InvalidRequest(f"reward_function: no such reward function: {body.reward_function}",
                                 param="reward_function")
        return fn.spec, fn.id, "reward_function"
    if body.grader is not None:
        from service.schemas import graders

        return graders.grader_reward(body.grader, param="grader"), None, "grader"
    if source is not None and source.spec.get("reward") is not None:
        return source.spec["reward"], source.reward_function_id, "model"
    raise InvalidRequest("reward: give reward, reward_function or grader (only a fine-tuned model or checkpoint "
                         "whose job had a reward may leave them out)", param="reward")


def check_quota(session: Session, project_id: str, settings: Settings | None) -> None:
    """One more queued or running eval must fit in the project's cap (429: it frees up as runs end)."""
    if settings is None:
        return
    active = evals_repo.active_count(session, project_id)
    if active >= settings.max_active_evals:
        raise TooManyRequests(f"quota: this project has {active} queued or running eval runs, its limit "
                              f"(CISPO_MAX_ACTIVE_EVALS={settings.max_active_evals}); wait for one to finish or "
                              "cancel one (POST /v1/evals/{id}/cancel)", retry_after_s=30,
                              code="active_eval_quota_exceeded")


def create(session: Session, store: ObjectStore, project_id: str, body: EvalCreate, *,
           settings: Settings | None = None) -> EvalRun:
    start = starts.resolve(session, project_id, body.model) if starts.names_a_start(body.model) else None
    source = jobs_repo.get(session, project_id, start.source_job_id) if start is not None else None
    base = start.base_model if start else body.model
    if settings is not None:
        if start is None:  # a fine-tuned model's base was checked when its job was created
            check_known_base(session, project_id, base, settings, param="model")
        check_quota(session, project_id, settings)
    file = dataset_file(session, project_id, body.file, "file")
    reward, reward_function_id, reward_param = _reward(session, project_id, body, source)
    inherited = {k: source.spec[k] for k in ("dtype", "sampling", "rollout") if source and k in source.spec}
    data = {**inherited, "model": base, "seed": 0, "data": {"train_file": file.id}, "reward": reward,
            "lora": start.lora if start else None, "init_from": start.checkpoint_id if start else None,
            "training": {"steps": 1, "eval_max_rows": body.max_rows, "preflight_groups": 0}}
    if body.sampling is not None:
        data["sampling"] = body.sampling.model_dump()
    if start is None:  # the base model: no adapter to load, nothing trains
        data.pop("lora")
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        raise invalid_value(e, data, path=lambda p: "sampling" if p.startswith("sampling") else
                            ("reward" if p.startswith("reward") else "model")) from None
    if settings is not None and body.sampling is not None:
        check_lengths(spec.sampling, body.sampling.model_fields_set,
                      max_positions(known_config(base, settings)), param="sampling")
    check_reward_references(session, project_id, spec.reward, param=reward_param, settings=settings)
    check_rows_fit_method(session, store, project_id, spec)
    return evals_repo.add(session, EvalRun(
        project_id=project_id, status="queued", model=body.model, checkpoint_id=start.checkpoint_id if start else None,
        file_id=file.id, reward_function_id=reward_function_id, spec=spec.model_dump(mode="json"),
        metadata_=body.metadata))


def get(session: Session, project_id: str, eval_id: str) -> EvalRun:
    run = evals_repo.get(session, project_id, eval_id)
    if run is None:
        raise NotFound(f"no such eval run: {eval_id}", param="eval_id")
    return run


def cancel(session: Session, project_id: str, eval_id: str) -> EvalRun:
    """A queued run is cancelled at once, a running one when its worker next checks; an ended one is a 409."""
    run = get(session, project_id, eval_id)
    try:
        return evals_repo.request_cancel(session, run)
    except evals_repo.IllegalTransition as e:
        raise Conflict(str(e), code="invalid_eval_state") from None


def list_runs(session: Session, project_id: str, *, after: str | None, limit: int) -> Page[EvalRun]:
    return evals_repo.page(session, project_id, after=after, limit=limit)
