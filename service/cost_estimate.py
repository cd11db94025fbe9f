"""The dry run's cost before start: trained tokens the job should train on, and worker-seconds from earlier jobs.

- Expected trained tokens (a CISPO job): steps x batch_size x group_size x update_epochs x the completion
  tokens per sample, since the update trains on every completion's action tokens once per epoch (prompts
  are context). Per sample: what this project's earlier jobs on the model really sampled (their median
  completion_length_mean, scaled to this job's max_output_tokens as the time estimate scales it), else
  the cap, max_output_tokens x max_turns, and then the figure is an upper bound (said so).
- Expected worker-seconds: this project's earlier finished jobs' wall-clock seconds (start to finish) per
  trained token, median over them, times the expected tokens; from jobs on the same model when any exist,
  else from the project's jobs on other models (said so), else none (said so). Wall-clock includes loading,
  evaluations and checkpoints, and a paused job's pause (a cautious over-estimate).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from sqlalchemy.orm import Session

from service.job_spec.spec import JobSpec
from service.repositories import job_estimates

HISTORY_JOBS = 20  # the newest finished jobs looked at


@dataclass
class Cost:
    trained_tokens: int | None
    worker_seconds: int | None
    message: str


def _sample_tokens(session: Session, project_id: str, spec: JobSpec) -> tuple[float, str]:
    """Completion tokens per sample, and how they were found."""
    cap = spec.sampling.max_output_tokens * spec.training.max_turns
    lengths = []
    for job_id, job_spec, *_ in job_estimates.recent_on_model(session, project_id, spec.model, limit=HISTORY_JOBS):
        values = job_estimates.metric_values(session, job_id, ("completion_length_mean",)).get(
            "completion_length_mean", [])
        if not values:
            continue
        earlier_cap = job_spec["sampling"]["max_output_tokens"] * job_spec["training"].get("max_turns", 1)
        length = median(values)
        # Completions end at EOS: only those that ran into the earlier cap (90%+) are taken to grow with this one.
        lengths.append(cap * length / earlier_cap if length >= 0.9 * earlier_cap else min(float(cap), length))
    if lengths:
        per_sample = median(lengths)
        return per_sample, f"{per_sample:.1f} completion tokens per sample, from {len(lengths)} " \
                                 "earlier job(s) of this project on this model"
    return float(cap), f"at most {cap} completion tokens per sample (max_output_tokens x max_turns; no earlier job " \
                       "of this project on this model to measure them), so an upper bound"


def expected_trained_tokens(session: Session, project_id: str, spec: JobSpec) -> tuple[int | None, str]:
    if spec.method != "cispo":
        return None, "trained tokens are not estimated for a supervised job before it runs"
    tc = spec.training
    per_sample, how = _sample_tokens(session, project_id, spec)
    tokens = round(tc.steps * tc.batch_size * tc.group_size * tc.update_epochs * per_sample)
    return tokens, (f"about {tokens} trained tokens ({tc.steps} steps x {tc.batch_size * tc.group_size} samples x "
                    f"{tc.update_epochs} update epoch(s) x {how})")


def _seconds_per_token(session: Session, project_id: str, model: str | None) -> list[float]:
    rows = job_estimates.trained_runs(session, project_id, model, limit=HISTORY_JOBS)
    return [max(finished - started, 1) / tokens for started, finished, tokens in rows]


def estimate_cost(session: Session, project_id: str, spec: JobSpec) -> Cost:
    tokens, how = expected_trained_tokens(session, project_id, spec)
    if tokens is None:
        return Cost(None, None, how)
    rates, where = _seconds_per_token(session, project_id, spec.model), "on this model"
    if not rates:
        rates, where = _seconds_per_token(session, project_id, None), "on other models (none on this one)"
    if not rates:
        return Cost(tokens, None, f"{how}; worker-seconds not estimated: this project has no earlier succeeded "
                                  "job that trained")
    rate = median(rates)
    seconds = round(rate * tokens)
    return Cost(tokens, seconds, f"{how}; about {seconds} worker-seconds at {rate * 1000:.3g} s per 1000 "
                                 f"trained tokens, the median of {len(rates)} earlier succeeded job(s) of this "
                                 f"project {where} (start to finish)")
