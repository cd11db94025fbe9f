"""The body of POST /v1/fine_tuning/jobs: OpenAI's shape, with a `cispo` method of ours.

`method.type` picks one of two sections:
- `cispo`: our knobs. Its hyperparameters are the JobSpec sections themselves,
  so the API applies exactly the bounds the worker relies on.
- `reinforcement`: OpenAI's RFT shape, mapped onto CISPO by service/job_spec/build.py.
- `supervised`: OpenAI's SFT shape (chat rows ending with the assistant's turn), a warm start that a
  `cispo` job continues by naming the fine-tuned model as its `model`.
The choice is a plain `type` plus two optional fields (not a pydantic tagged
union) so error paths read like the JSON the client wrote:
"method.cispo.hyperparameters.training.group_size".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from service.schemas.api import Metadata, Request, ServiceReward, Text
from service.schemas.environments import EnvironmentRef
from service.schemas.integrations import Integrations
from service.job_spec.objective import AdvantageSpec, CispoLossSpec, OptimizerSpec, Schedule
from service.job_spec.sampling import RolloutSpec, SamplingSpec
from service.job_spec.spec import LoraSpec, ResourcesSpec, TrainingSpec
from service.job_spec.strict import refuse_float16_training

Auto = Literal["auto"]


class CispoHyperparameters(Request):
    """The JobSpec sections a client may set; anything left out takes the JobSpec default."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    lora: LoraSpec | None = Field(None, description="Left out: the default adapter; null: full fine-tuning.")
    resources: ResourcesSpec | None = None
    sampling: SamplingSpec | None = None
    rollout: RolloutSpec | None = None
    advantages: AdvantageSpec | None = None
    loss: CispoLossSpec | None = None
    optimizer: OptimizerSpec | None = None
    schedule: Schedule | None = None
    training: TrainingSpec | None = None

    @field_validator("dtype")
    @classmethod
    def _no_float16_training(cls, value: str | None) -> str | None:
        return refuse_float16_training(value)


class CispoMethod(Request):
    reward_function: Text | None = Field(
        None,
        description="Id (rwfn-...) of a reward function registered with POST /v1/reward_functions in this "
        "project; the job copies its spec at creation, so later changes to the registry do not affect it. Each "
        "completion is scored with the row's fields: e.g. exact_match compares it with row[field], a python "
        "reward is called as reward(completion, **row) in a sandbox. Give exactly one of reward_function, "
        "reward or environment.",
    )
    reward: ServiceReward | None = Field(None, description="An inline reward spec (the same types as a registered "
                                         "reward function).")
    environment: EnvironmentRef | None = Field(
        None, description="A multi-turn environment instead of a reward: a registered id (env-...) or an inline spec.")
    hyperparameters: CispoHyperparameters = CispoHyperparameters()

    @model_validator(mode="after")
    def _one_reward(self) -> CispoMethod:
        given = [x for x in (self.reward_function, self.reward, self.environment) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of reward_function (a registered id), reward (an inline spec) or "
                             "environment (a registered id or an inline spec)")
        return self


class ReinforcementHyperparameters(Request):
    """OpenAI's RFT hyperparameters; each takes a value or "auto"."""

    batch_size: Annotated[int, Field(ge=1, le=256)] | Auto = "auto"
    learning_rate_multiplier: Annotated[float, Field(gt=0, le=1000)] | Auto = "auto"
    n_epochs: Annotated[int, Field(ge=1, le=50)] | Auto = "auto"
    eval_interval: Annotated[int, Field(ge=1)] | Auto = "auto"
    eval_samples: Annotated[int, Field(ge=1)] | Auto = "auto"
    compute_multiplier: Annotated[float, Field(gt=0.00001, le=10)] | Auto = "auto"
    reasoning_effort: str | None = None

    @field_validator("reasoning_effort")
    @classmethod
    def _no_reasoning_effort(cls, v: str | None) -> str | None:
        if v not in (None, "auto"):
            raise ValueError(f"reasoning_effort {v!r} is not supported (only 'auto'): CISPO jobs sample as given")
        return v


class ReinforcementMethod(Request):
    grader: dict[str, Any] = Field(description="An OpenAI grader: string_check, text_similarity, python, "
                                   "score_model or multi (service/schemas/graders.py).")
    hyperparameters: ReinforcementHyperparameters = ReinforcementHyperparameters()
    response_format: None = Field(None, description="Structured outputs are not supported yet; must be null.")


class SupervisedHyperparameters(Request):
    """OpenAI's SFT hyperparameters (each a value or "auto"), plus the adapter and precision of ours."""

    batch_size: Annotated[int, Field(ge=1, le=256)] | Auto = "auto"
    learning_rate_multiplier: Annotated[float, Field(gt=0, le=10000)] | Auto = "auto"
    n_epochs: Annotated[int, Field(ge=1, le=50)] | Auto = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    lora: LoraSpec | None = Field(None, description="Left out: the default adapter; null: full fine-tuning.")
    sampling: SamplingSpec | None = Field(None, description="How evaluations sample (greedy; lengths).")
    training: TrainingSpec | None = Field(None, description="Our training section (checkpoint_interval, "
                                          "eval_max_rows, micro_batch_size...); batch_size and n_epochs win.")

    @field_validator("dtype")
    @classmethod
    def _no_float16_training(cls, value: str | None) -> str | None:
        return refuse_float16_training(value)


class SupervisedMethod(Request):
    hyperparameters: SupervisedHyperparameters = SupervisedHyperparameters()
    reward_function: Text | None = Field(None, description="Optional: a registered reward that scores the job's "
                                         "evaluations (greedy completions of the validation prompts).")
    reward: ServiceReward | None = Field(None, description="Optional: an inline reward for the evaluations.")

    @model_validator(mode="after")
    def _at_most_one_reward(self) -> SupervisedMethod:
        if self.reward_function is not None and self.reward is not None:
            raise ValueError("give at most one of reward_function or reward")
        return self


METHODS = ("cispo", "reinforcement", "supervised")


class Method(Request):
    type: Literal["cispo", "reinforcement", "supervised"]
    cispo: CispoMethod | None = None
    reinforcement: ReinforcementMethod | None = None
    supervised: SupervisedMethod | None = None

    @model_validator(mode="after")
    def _section_matches_type(self) -> Method:
        given = getattr(self, self.type)
        if given is None:
            raise ValueError(f"method.type is {self.type!r}, so method.{self.type} is required")
        for other in METHODS:
            if other != self.type and getattr(self, other) is not None:
                raise ValueError(f"method.type is {self.type!r}, so method.{other} must be left out")
        return self


class JobCreate(Request):
    model: Text = Field(min_length=1, max_length=512)
    training_file: Text = Field(min_length=1)
    validation_file: Text | None = None
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    suffix: Text | None = Field(None, max_length=64)
    metadata: Metadata | None = None
    method: Method
    integrations: Integrations | None = Field(
        None, description="Experiment trackers the worker logs to: wandb (OpenAI's shape) or mlflow "
        "(service/schemas/integrations.py).")
    hyperparameters: dict[str, Any] | None = Field(None, description="Deprecated by OpenAI; refused unless empty.")

    @field_validator("hyperparameters")
    @classmethod
    def _no_top_level_hyperparameters(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("top-level hyperparameters are deprecated; set method.<type>.hyperparameters instead")
        return v
