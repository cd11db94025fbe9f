"""What a reward spec refers to outside itself, checked when a job or reward function is created.

Fail fast: a secret the project does not have (or not for that URL's host), a URL the egress policy will
refuse, or a judge model with no endpoint would otherwise fail the job at its
first step, after it waited in the queue. The worker checks again at job
start (a secret may have been deleted, DNS may have changed).
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.egress import EgressPolicy, EgressRefused, check_url
from service.errors import InvalidRequest
from service.schemas.rewards import HttpReward, MultiReward, ScoreModelReward
from service.secrets.store import check_bindings
from service.settings import Settings


def _remote(spec) -> list[HttpReward | ScoreModelReward]:
    if isinstance(spec, MultiReward):
        return [r for sub in spec.rewards.values() for r in _remote(sub)]
    return [spec] if isinstance(spec, (HttpReward, ScoreModelReward)) else []


def service_judges(spec) -> int:
    """How many of the spec's parts are score_model graders on the service's own judge (no base_url)."""
    return sum(1 for r in _remote(spec) if isinstance(r, ScoreModelReward) and r.base_url is None)


def _check_service_judge(spec: ScoreModelReward, param: str, settings: Settings) -> None:
    """The operator's judge serves only the models it lists, with replies of at most judge_max_tokens."""
    models = settings.resolved_judge_models()
    if spec.model not in models:
        listed = ", ".join(repr(m) for m in models) if models else "none (CISPO_JUDGE_MODELS is empty)"
        raise InvalidRequest(f"{param}.model: {spec.model!r} is not a model this service's judge offers; it offers "
                             f"{listed}; or give base_url", param=f"{param}.model", code="judge_model_not_allowed")
    asked = spec.sampling_params.max_completions_tokens
    if asked is not None and asked > settings.judge_max_tokens:
        field = f"{param}.sampling_params.max_completions_tokens"
        raise InvalidRequest(f"{field}: {asked} is more than this service's judge gives one reply "
                             f"({settings.judge_max_tokens})", param=field, code="judge_tokens_too_many")


def check_reward_references(session: Session, project_id: str, spec, *, param: str,
                            settings: Settings | None) -> None:
    """Raise InvalidRequest (naming ``param``) for a missing secret, a refused URL or a missing judge endpoint.

    Without settings (callers that have none) only the secrets and their hosts are checked.
    """
    check_bindings(session, project_id, [(r.auth_secret, str(r.url if isinstance(r, HttpReward) else r.base_url))
                                         for r in _remote(spec) if r.auth_secret], param=param)
    if settings is None:
        return
    policy = EgressPolicy.from_setting(settings.egress_allow)
    for remote in _remote(spec):
        url = remote.url if isinstance(remote, HttpReward) else remote.base_url
        if isinstance(remote, ScoreModelReward) and url is None:
            if not settings.judge_base_url:
                raise InvalidRequest(f"{param}: score_model needs a judge endpoint and this service has none "
                                     "configured (CISPO_JUDGE_BASE_URL); give base_url", param=param,
                                     code="no_judge_endpoint")
            _check_service_judge(remote, param, settings)
            continue
        try:
            check_url(url, policy)
        except EgressRefused as e:
            raise InvalidRequest(f"{param}: {e}", param=param, code="egress_refused") from None
