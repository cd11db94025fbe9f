"""POST /v1/fine_tuning/jobs?dry_run=true: everything that can be known about a job before it runs.

After the request resolves to a JobSpec (service/jobs.py prepare), a dry run
checks what would otherwise fail or mislead hours later:

- model: the model resolves (service/models/check.py);
- reward_fields: every row field the reward reads is in every row (the lines
  that lack one are listed); what user code reads is reported as not checked;
- prompt_lengths: prompts fit in sampling.max_model_len - max_output_tokens,
  counted with the model's tokenizer when `tokenizers` and a local
  tokenizer.json are at hand, else estimated from characters (stated);
- engine: with rollout.engine vllm, what vLLM would refuse at engine start
  (service/models/engine_check.py): the attention head size, the LoRA rank;
- quantization: lora.base_quantization nf4 (QLoRA) needs bitsandbytes;
- estimate: the run's duration from the step rate this project's earlier jobs
  on the same model measured, scaled by the tokens they really sampled per
  step, plus their time outside the steps;
- cost: expected trained tokens and worker-seconds (service/cost_estimate.py).

A failed check refuses the request (400, all failures named); the answer
lists every check with what it found, including what was not checked.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.orm import Session

from service import files as files_service
from service.cost_estimate import estimate_cost
from service.errors import InvalidRequest
from service.models.check import ModelInfo, ModelProblem, check_model
from service.models.hub_cache import max_positions
from service.models.lengths import length_problems, requested_sampling
from service.models.engine_check import RULES, cpu_accepts, cuda_accepts, head_size, lora_rank_problem
from service.repositories import job_estimates
from service.rewards.fields import FieldUse, fields_read, has_path
from service.schemas.dataset import row_prompt
from service.job_spec.request import JobCreate
from service.job_spec.spec import JobSpec
from service.storage import ObjectStore

CHARS_PER_TOKEN = 3  # when no tokenizer is at hand: a cautious average for BPE tokenizers on English text
MESSAGE_OVERHEAD_TOKENS = 8  # chat template tokens around each message (role markers), when not rendered
MAX_LINES_SHOWN = 10
HISTORY_JOBS = 5


@dataclass
class Check:
    name: str
    status: str  # passed | failed | warning | skipped
    message: str
    param: str | None = None


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    estimated_seconds: int | None = None
    expected_trained_tokens: int | None = None
    expected_worker_seconds: int | None = None

    def add(self, name: str, status: str, message: str, param: str | None = None) -> None:
        self.checks.append(Check(name, status, message, param))


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:MAX_LINES_SHOWN]))
    return shown + (f" (and {len(numbers) - MAX_LINES_SHOWN} more)" if len(numbers) > MAX_LINES_SHOWN else "")


class _Counter:
    """Prompt tokens: counted with the model's tokenizer.json where possible, else estimated from characters."""

    def __init__(self, model: ModelInfo | None):
        self.tokenizer = None
        if model is not None and model.tokenizer_json is not None:
            try:
                from tokenizers import Tokenizer

                self.tokenizer = Tokenizer.from_file(str(model.tokenizer_json))
            except Exception:  # an unreadable tokenizer.json: fall back to the estimate, and say so
                self.tokenizer = None

    def _text(self, text: str, special: bool) -> int:
        if self.tokenizer is None:
            return math.ceil(len(text) / CHARS_PER_TOKEN)
        return len(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def count(self, prompt) -> tuple[int, bool]:
        """(tokens, exact): a string prompt with a tokenizer is exact; chat templates are not rendered here."""
        if isinstance(prompt, str):
            return self._text(prompt, True), self.tokenizer is not None
        return sum(self._text(m["content"], False) + MESSAGE_OVERHEAD_TOKENS for m in prompt), False

    def how(self) -> str:
        if self.tokenizer is None:
            return f"estimated at {CHARS_PER_TOKEN} characters per token (no local tokenizer.json)"
        return "counted with the model's tokenizer.json"


def dataset_rows(session: Session, store: ObjectStore, project_id: str, spec: JobSpec) -> Iterator[tuple[str, int, dict]]:
    for param, file_id in (("training_file", spec.data.train_file), ("validation_file", spec.data.validation_file)):
        if file_id:
            for line, row in files_service.iter_rows(store, files_service.get(session, project_id, file_id)):
                yield param, line, row


def _note_missing(missing: dict[tuple[str, str, str], list[int]], file_param: str, line: int, row: dict,
                  uses: list[FieldUse]) -> None:
    for use in uses:
        if not has_path(row, use.path):
            missing.setdefault((file_param, use.shown, use.param), []).append(line)


def _missing_failures(missing: dict[tuple[str, str, str], list[int]], reward_param: str) -> list[tuple[str, str]]:
    """(message, param) per reward field some rows of a file lack."""
    return [(f"{reward_param}.{param} reads row field {shown!r}, which {file_param} lacks on line(s) "
             f"{_lines(lines)}", f"{reward_param}.{param}") for (file_param, shown, param), lines in missing.items()]


def reward_param(body: JobCreate) -> str:
    """Where the request names the reward (errors about what it reads point there)."""
    if body.method.type == "reinforcement":
        return "method.reinforcement.grader"
    if body.method.type == "supervised":
        sft = body.method.supervised
        return "method.supervised.reward_function" if sft.reward_function else "method.supervised.reward"
    return "method.cispo.reward_function" if body.method.cispo.reward_function else "method.cispo.reward"


def check_reward_fields(session: Session, store: ObjectStore, project_id: str, body: JobCreate,
                        spec: JobSpec) -> None:
    """At create: refuse (400) a job whose training or validation rows lack a field the reward reads, as the dry
    run does; a validation row without it would score 0 with a reward error at every evaluation."""
    if spec.reward is None:
        return
    uses, _ = fields_read(spec.reward.model_dump(mode="json"))
    if not uses:
        return
    missing: dict[tuple[str, str, str], list[int]] = {}
    for file_param, line, row in dataset_rows(session, store, project_id, spec):
        _note_missing(missing, file_param, line, row, uses)
    if failures := _missing_failures(missing, reward_param(body)):
        raise InvalidRequest("; ".join(message for message, _ in failures), param=failures[0][1],
                             code="missing_reward_field")


def _lengths(report: Report, body: JobCreate, spec: JobSpec, positions: int | None) -> None:
    """The sampling lengths against the model's positions: a length the request set is a failure, a default one
    a warning (the job would still run, past what the model was trained on)."""
    if positions is None:
        return
    explicit, param = requested_sampling(body)
    problems = length_problems(spec.sampling, positions)
    for field_name, problem in problems:
        status, how = ("failed", "") if field_name in explicit else ("warning", " (the default)")
        report.add("lengths", status, f"{param}.{field_name}: {problem}{how}; set {field_name} "
                   f"{'at most' if field_name == 'max_model_len' else 'below'} {positions}",
                   f"{param}.{field_name}")
    if not problems:
        report.add("lengths", "passed", f"max_model_len {spec.sampling.max_model_len} is within the model's "
                   f"{positions} positions")


def _scan(report: Report, rows: Iterator[tuple[str, int, dict]], spec: JobSpec, uses: list[FieldUse],
          counter: _Counter, reward_param: str, positions: int | None = None) -> None:
    """One pass over the rows: missing reward fields, prompts that do not fit."""
    missing: dict[tuple[str, str, str], list[int]] = {}
    model_len = spec.sampling.max_model_len
    if positions is not None and spec.sampling.max_output_tokens < positions < model_len:
        model_len = positions  # what the model really holds (the lengths check says why)
    limit = model_len - spec.sampling.max_output_tokens
    longest, over_exact, over_estimated = 0, {}, {}
    for file_param, line, row in rows:
        _note_missing(missing, file_param, line, row, uses)
        tokens, exact = counter.count(row_prompt(row))
        longest = max(longest, tokens)
        if tokens > limit:
            (over_exact if exact else over_estimated).setdefault(file_param, []).append(line)

    if uses:
        if missing:
            for message, param in _missing_failures(missing, reward_param):
                report.add("reward_fields", "failed", message, param)
        else:
            names = ", ".join(sorted({repr(u.shown) for u in uses}))
            report.add("reward_fields", "passed", f"every row has {names}")

    sampling = "method.cispo.hyperparameters.sampling" if reward_param.startswith("method.cispo") else None
    fitted = "max_model_len" if model_len == spec.sampling.max_model_len else "the model's positions"
    where = f"{fitted} - max_output_tokens = {limit} tokens; prompts {counter.how()}"
    for file_param, lines in over_exact.items():
        report.add("prompt_lengths", "failed", f"{file_param}: prompts on line(s) {_lines(lines)} are longer than "
                   f"{where}", sampling)
    for file_param, lines in over_estimated.items():
        report.add("prompt_lengths", "warning", f"{file_param}: prompts on line(s) {_lines(lines)} may be longer "
                   f"than {where} (chat messages: contents plus about {MESSAGE_OVERHEAD_TOKENS} tokens each)",
                   sampling)
    if not over_exact and not over_estimated:
        report.add("prompt_lengths", "passed", f"the longest prompt is {longest} tokens, within {where}")


def _engine(report: Report, spec: JobSpec, model: ModelInfo | None, param: str) -> None:
    """What vLLM would refuse at engine start, as far as the model's config tells (the worker's device is
    unknown here: a head size only one kind of device takes is a warning)."""
    if spec.rollout.engine != "vllm":
        return
    rollout = f"{param}.rollout.engine"
    if spec.lora is not None and (problem := lora_rank_problem(spec.lora.r)):
        report.add("engine", "failed", f"rollout.engine vllm: {problem}", f"{param}.lora.r")
    head = head_size(model.config) if model is not None and model.config is not None else None
    if head is None:
        report.add("engine", "skipped", "rollout.engine vllm: the model's config was not read, so its attention "
                   "head size was not checked")
        return
    cpu, cuda = cpu_accepts(head), cuda_accepts(head)
    if not (cpu or cuda):
        report.add("engine", "failed", f"rollout.engine vllm cannot run attention head size {head} on any device "
                   f"({RULES}); use rollout.engine hf", rollout)
    elif not (cpu and cuda):
        report.add("engine", "warning", f"rollout.engine vllm: attention head size {head} runs only on a "
                   f"{'CUDA' if cuda else 'CPU'} worker ({RULES}); elsewhere the job fails at engine start",
                   rollout)
    else:
        report.add("engine", "passed", f"rollout.engine vllm: attention head size {head} runs on CPU and CUDA")


def _quantization(report: Report, spec: JobSpec, param: str) -> None:
    """QLoRA needs bitsandbytes (not a dependency of this project): refused where it is not installed."""
    if spec.lora is None or spec.lora.base_quantization == "none":
        return
    try:
        found = importlib.util.find_spec("bitsandbytes") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        report.add("quantization", "passed", "lora.base_quantization nf4: bitsandbytes is installed here; the worker "
                   "needs it too, with a CUDA GPU")
    else:
        report.add("quantization", "failed", "lora.base_quantization is 'nf4' (QLoRA) but bitsandbytes is not "
                   "installed: install it on a CUDA worker, or set lora.base_quantization to 'none'",
                   f"{param}.lora.base_quantization")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _expected_length(max_tokens: int, earlier_length: float, earlier_max: int) -> float:
    """Completion tokens per sample the new job should see: completions end at EOS, so their length is the
    task's, not the cap's; only completions that ran into the earlier cap (90% of it or more) are taken to
    grow with a larger one."""
    if earlier_length >= 0.9 * earlier_max:
        return max_tokens * earlier_length / earlier_max
    return min(float(max_tokens), earlier_length)


def _estimate(session: Session, project_id: str, body: JobCreate, spec: JobSpec) -> tuple[int | None, str]:
    """Seconds for the run, from earlier jobs of this project on this model.

    Per earlier job: its median step_seconds (a median, so a slow first step or a busy moment does not
    skew it) per sampled token, where sampled tokens are what it really generated (completion_length_mean,
    not max_output_tokens: scaling by the cap overestimated runs whose completions end early), scaled to this
    job's sequences and expected completion lengths; plus what the job spent outside its steps (loading,
    evaluations, checkpoints), from its wall-clock time. The median over the jobs is the estimate."""
    earlier = job_estimates.recent_on_model(session, project_id, body.model, limit=HISTORY_JOBS)
    tc = spec.training
    per_step_estimates, overheads = [], []
    for job_id, job_spec, started, finished, status in earlier:
        values = job_estimates.metric_values(session, job_id, ("step_seconds", "completion_length_mean"))
        if not values.get("step_seconds"):
            continue
        t, cap = job_spec["training"], job_spec["sampling"]["max_output_tokens"]
        length = _median(values["completion_length_mean"]) if values.get("completion_length_mean") else cap
        length = max(length, 1.0)
        rate = _median(values["step_seconds"]) / (t["batch_size"] * t["group_size"] * length)
        expected = _expected_length(spec.sampling.max_output_tokens, length, cap)
        per_step_estimates.append(rate * tc.batch_size * tc.group_size * expected)
        if status == "succeeded" and started and finished:
            overheads.append(max(finished - started - sum(values["step_seconds"]), 0.0))
    if not per_step_estimates:
        return None, "no earlier job of this project on this model has measured a step rate"
    per_step = _median(per_step_estimates)
    overhead = _median(overheads) if overheads else 0.0
    total = round(per_step * tc.steps + overhead)
    outside = f" + {overhead:.0f} s outside the steps (loading, evaluations, checkpoints)" if overheads else \
        "; evaluations and checkpoints add to it"
    return total, (f"about {total} s ({tc.steps} steps of {per_step:.2f} s{outside}), from {len(per_step_estimates)} "
                   "earlier job(s) on this model, scaled by sampled tokens per step")


def dry_run(session: Session, store: ObjectStore, project_id: str, body: JobCreate, spec: JobSpec, *,
            hub_url: str, hub_cache: Path | None = None, hub_offline: bool = False) -> Report:
    """Run every check; raises InvalidRequest naming all failures."""
    report = Report()
    model = None
    try:
        # spec.model: a continued job's base model
        model = check_model(spec.model, hub_url=hub_url, cache=hub_cache, offline=hub_offline)
        report.add("model", model.status, f"model: {model.detail}")
    except ModelProblem as e:
        report.add("model", "failed", f"model: {e}", "model")

    where = reward_param(body)
    uses: list[FieldUse] = []
    if spec.reward is not None:
        uses, opaque = fields_read(spec.reward.model_dump(mode="json"))
        for at, why in opaque:
            report.add("reward_fields", "skipped", f"{where}{'.' + at if at else ''}: not checked, {why}")
    else:
        report.add("reward_fields", "skipped", "an environment reads rows in its own code: not checked")
    positions = max_positions(model.config) if model is not None else None
    _lengths(report, body, spec, positions)
    _scan(report, dataset_rows(session, store, project_id, spec), spec, uses, _Counter(model), where, positions)

    _engine(report, spec, model, "method.cispo.hyperparameters")
    _quantization(report, spec, "method.cispo.hyperparameters")
    report.estimated_seconds, how = _estimate(session, project_id, body, spec)
    report.add("estimate", "passed" if report.estimated_seconds is not None else "skipped", how)
    cost = estimate_cost(session, project_id, spec)
    report.expected_trained_tokens, report.expected_worker_seconds = cost.trained_tokens, cost.worker_seconds
    report.add("cost", "passed" if cost.worker_seconds is not None else "skipped", cost.message)

    failed = [c for c in report.checks if c.status == "failed"]
    if failed:
        raise InvalidRequest(f"dry run: {len(failed)} check(s) failed: " + "; ".join(c.message for c in failed),
                             param=failed[0].param, code="dry_run_failed")
    return report
