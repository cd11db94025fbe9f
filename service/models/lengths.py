"""A job's or an eval's lengths against the base model: a sequence longer than the model's positions is past
what it was trained on (learned position tables index out of range; rotary ones degrade), so a length the user
set beyond them is refused (400 naming the field) wherever the model's config.json is at hand (service/models/
hub_cache.py). Defaults are not the user's doing: the dry run warns about those."""

from __future__ import annotations

from typing import Protocol

from service.errors import InvalidRequest


class SamplingSpec(Protocol):  # service/job_spec/sampling.py's, which imports service.models
    max_model_len: int
    max_output_tokens: int


def check_lengths(sampling: SamplingSpec, explicit: set[str], positions: int | None, *, param: str) -> None:
    """Raises InvalidRequest for a length in `explicit` (the fields the request set) the model cannot take."""
    if positions is None:
        return
    if "max_model_len" in explicit and sampling.max_model_len > positions:
        field = f"{param}.max_model_len"
        raise InvalidRequest(f"{field}: {sampling.max_model_len} is more than the {positions} positions the model "
                             f"takes (max_position_embeddings in its config.json); use at most {positions}",
                             param=field, code="invalid_value")
    if "max_output_tokens" in explicit and sampling.max_output_tokens >= positions:
        field = f"{param}.max_output_tokens"
        raise InvalidRequest(f"{field}: {sampling.max_output_tokens} leaves no room for a prompt in the "
                             f"{positions} positions the model takes (max_position_embeddings in its "
                             f"config.json); use fewer than {positions}", param=field, code="invalid_value")


def requested_sampling(body) -> tuple[set[str], str]:
    """(the sampling fields a job request set, where they sit in it)."""
    hyperparameters = getattr(getattr(body.method, body.method.type), "hyperparameters", None)
    requested = getattr(hyperparameters, "sampling", None)
    return (set(requested.model_fields_set) if requested is not None else set(),
            f"method.{body.method.type}.hyperparameters.sampling")


def length_problems(sampling: SamplingSpec, positions: int) -> list[tuple[str, str]]:
    """(field, what is wrong) for each length the model cannot take, set or defaulted."""
    problems = []
    if sampling.max_model_len > positions:
        problems.append(("max_model_len", f"max_model_len is {sampling.max_model_len}, more than the {positions} "
                                          "positions the model takes"))
    if sampling.max_output_tokens >= positions:
        problems.append(("max_output_tokens", f"max_output_tokens is {sampling.max_output_tokens}, which leaves no "
                                              f"room for a prompt in the model's {positions} positions"))
    return problems
