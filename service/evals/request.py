"""POST /v1/evals and the eval run object (service/evals/runs.py).

One object per run, named like OpenAI's eval runs (`object: "eval.run"`, `result_counts`), flattened: the
model to score (a base model, a fine-tuned model `ft:...`, a checkpoint's name or id), the file of rows,
and the reward that scores each greedy completion (inline, registered, or an OpenAI grader; left out for a
fine-tuned model or checkpoint: its job's own reward).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from service.schemas.api import Metadata, Request, ServiceReward, Text
from service.job_spec.sampling import SamplingSpec

MAX_EVAL_ROWS = 10_000


class EvalCreate(Request):
    model: Text = Field(min_length=1, max_length=512, description="A base model, a fine-tuned model (ft:...), a "
                        "checkpoint's fine_tuned_model_checkpoint or a checkpoint id (ftckpt_...).")
    file: Text = Field(min_length=1, description="A fine-tune file (file-...) whose rows are the prompts.")
    reward: ServiceReward | None = None
    reward_function: Text | None = Field(None, description="A registered reward (rwfn-...).")
    grader: dict[str, Any] | None = Field(None, description="An OpenAI grader (as in reinforcement jobs).")
    max_rows: int = Field(1000, ge=1, le=MAX_EVAL_ROWS, description="Score the file's first max_rows rows.")
    sampling: SamplingSpec | None = Field(None, description="Lengths for the greedy completions; default: the "
                                          "source job's, or the job spec's defaults.")
    metadata: Metadata | None = None

    @model_validator(mode="after")
    def _at_most_one_reward(self) -> EvalCreate:
        given = [x for x in (self.reward, self.reward_function, self.grader) if x is not None]
        if len(given) > 1:
            raise ValueError("give at most one of reward, reward_function or grader")
        return self


class EvalResult(BaseModel):
    mean: float | None
    interval: list[float | None] = Field(description="95% interval of the mean: Wilson for 0/1 rewards, "
                                         "percentile bootstrap otherwise.")
    method: Literal["wilson", "bootstrap"]
    n: int


class EvalObject(BaseModel):
    object: Literal["eval.run"] = "eval.run"
    id: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    model: str
    checkpoint_id: str | None
    file: str
    reward: dict[str, Any] | None
    created_at: int
    started_at: int | None
    finished_at: int | None
    result: EvalResult | None
    result_counts: dict[str, int] | None = Field(None, description="total rows scored and errored ones.")
    result_files: list[str] = Field(description="The per-row JSONL (prompt, completion, reward): "
                                    "GET /v1/files/{id}/content.")
    error: dict[str, Any] | None
    metadata: dict[str, str] | None
