"""The job spec: the one validated object that the API accepts and the worker runs.

Torch-free on purpose, so the API process can validate a job without CUDA.
Every field has a default, a bound and an error that names it; unknown fields
are refused. Choices with their own knobs (schedule, reward, environment) are
discriminated unions on a ``type`` field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from service.job_spec.objective import (
    STALE_BATCH_MASK,
    AdvantageSpec,
    CispoLossSpec,
    ConstantSchedule,
    OptimizerSpec,
    Schedule,
)
from service.job_spec.sampling import RolloutSpec, SamplingSpec
from service.job_spec.strict import Strict, refuse_float16_training
from service.schemas.environments import EnvironmentSpec
from service.schemas.integrations import Integrations
from service.schemas.recipe import OffPolicyMaskSpec, PassRateFilterSpec
from service.schemas.rewards import AnyReward
from service.schemas.stopping import StopWhenSpec


class LoraSpec(Strict):
    r: int = Field(16, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names to adapt, or 'all-linear'.",
    )
    base_quantization: Literal["none", "nf4"] = Field(
        "none",
        description="'nf4': QLoRA, the frozen base held in 4-bit NF4 by bitsandbytes (a quarter of bf16's memory; "
        "the adapters train in float32 on top). Needs bitsandbytes on the worker (a CUDA GPU); refused otherwise.",
    )

    @model_validator(mode="after")
    def _non_empty(self) -> LoraSpec:
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("target_modules must name at least one module")
        return self


class ImportReward(Strict):
    """A trusted Python callable named as 'module:function' (local CLI runs only).

    It is called as fn(completion, **row) -> float.
    """

    type: Literal["import"] = "import"
    path: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


# 'import' runs a trusted callable inside the trainer: local CLI runs only, the
# service refuses it. The others are the service's RewardSpec (schemas/rewards.py).
Reward = Annotated[
    ImportReward | AnyReward,
    Field(discriminator="type"),
]


class DataSpec(Strict):
    train_file: str = Field(description="JSONL; each row has 'prompt' (string or chat messages).")
    validation_file: str | None = None
    validation_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Held out from train_file when validation_file is not given."
    )


class TrainingSpec(Strict):
    steps: int = Field(100, ge=1, le=1_000_000, description="Rollout steps (each samples one batch).")
    batch_size: int = Field(8, ge=1, le=4096, description="Prompts per step.")
    group_size: int = Field(8, ge=2, le=1024, description="Completions per prompt.")
    update_epochs: int = Field(1, ge=1, le=16, description="Passes over each rollout batch.")
    mini_batches: int = Field(
        4, ge=1, le=16, description="Optimizer steps per epoch; logp_old stays frozen at rollout."
    )
    micro_batch_size: int = Field(
        8, ge=1, le=4096, description="Sequences per forward/backward (gradient accumulation)."
    )
    logprob_chunk_size: int = Field(
        1024, ge=1, description="Token rows per log-softmax chunk; bounds logits memory."
    )
    pack_tokens: int | None = Field(
        None, ge=2, le=1_048_576,
        description="Sequence packing: the update puts sequences end to end in rows of at most this many tokens "
        "(one row per forward and backward, in place of micro_batch_size padded sequences), each attending to "
        "itself only; same log-probs and gradients, no padding. At least sampling.max_model_len, so no sequence "
        "is split. null: padded micro-batches.",
    )
    eval_interval: int = Field(0, ge=0, description="Evaluate every N steps (0: only first and last).")
    eval_max_rows: int = Field(64, ge=1)
    checkpoint_interval: int = Field(
        50, ge=0, le=100_000,
        description="Checkpoint every N steps, and always after the last (0: only the last). A crashed or "
        "preempted job resumes from its newest checkpoint, so this bounds the steps it can lose.",
    )
    checkpoint_keep: int = Field(
        3, ge=1, le=1000,
        description="Keep the newest N checkpoints of a job; older ones are deleted from storage as new ones "
        "are committed.",
    )
    reward_failure_score: float = 0.0
    reward_error_threshold: float = Field(
        0.5, ge=0.0, le=1.0,
        description="Fail the job when more than this fraction of a step's samples fail to score. 0.5 by default: "
        "a reward failing on most samples is broken (a bug, a dead endpoint) and every further step wastes the "
        "GPU, while failures on fewer samples are usually sample-specific (odd completions early in training) "
        "and still leave a learning signal; they are counted and shown in events. 1 never fails.",
    )
    preflight_groups: int = Field(
        2, ge=0, le=64,
        description="Before step 1, sample this many groups from the starting policy and score them: the baseline "
        "reward and the share of groups with zero reward variance (nothing to learn from) go to the job's events. "
        "0 skips it. The training run draws the same prompts and samples as without it.",
    )
    no_signal_steps: int = Field(
        5, ge=1, le=100_000,
        description="Warn (an event) when every group had zero reward variance for this many consecutive steps.",
    )
    fail_on_no_signal: bool = Field(
        False,
        description="Fail the job (error code no_learning_signal) when the pre-flight finds zero variance in every "
        "group, or when no_signal_steps consecutive steps do, instead of only warning.",
    )
    max_turns: int = Field(
        1, ge=1, le=64, description="Assistant turns per episode (environments; a reward function scores one turn)."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory, about a third more compute."
    )
    lm_head_float32: bool = Field(
        False,
        description="Run the LM head's matmul in float32 when the job computes in bfloat16 (ScaleRL's FP32 logits): "
        "log-probs and ratios without bf16 rounding of the logits, in the update and in the hf sampler. "
        "Logits are float32 after the head either way; this also makes the matmul float32.",
    )
    pass_rate_filter: PassRateFilterSpec | None = Field(
        None, description="ScaleRL's no-positive-resampling: retire prompts the policy solves; null: off."
    )
    export: Literal["adapter", "merged"] = Field(
        "adapter",
        description="'merged': with each checkpoint, the worker also stores the adapter merged into the base model "
        "(config.json, tokenizer, model.safetensors; loads with from_pretrained alone), downloaded with GET "
        ".../checkpoints/{id}/merged or `cispo jobs export --merge`. A LoRA job's option: a full fine-tuning "
        "checkpoint's model/ is already whole.",
    )

    stop_when: StopWhenSpec | None = Field(
        None, description="End the job early (succeeded) on an eval plateau or a target eval reward; needs "
        "eval_interval >= 1. null: train every step.")
    keep_best: bool = Field(
        False, description="Keep the checkpoint with the best eval beside the newest checkpoint_keep ones (never "
        "pruned); the job object's best_checkpoint names it.")

    @model_validator(mode="after")
    def _stopping_needs_evals(self) -> TrainingSpec:
        if self.stop_when is not None and self.eval_interval < 1:
            raise ValueError("training.stop_when decides on evals, so it needs training.eval_interval >= 1 "
                             "(0 evaluates only at the first and last step)")
        return self

    @model_validator(mode="after")
    def _mini_batches_fit(self) -> TrainingSpec:
        sequences = self.batch_size * self.group_size
        if self.mini_batches > sequences:
            raise ValueError(
                f"mini_batches ({self.mini_batches}) exceeds the sequences per step "
                f"(batch_size * group_size = {sequences})"
            )
        return self

    @property
    def updates_per_rollout(self) -> int:
        return self.update_epochs * self.mini_batches


class ResourcesSpec(Strict):
    """What a job asks of the worker."""

    gpus: int = Field(
        1, ge=1, le=64,
        description="Training processes, one per GPU (FSDP2 under torchrun when above 1; on a CPU-only worker the "
        "processes share the CPU over gloo). Each process generates whole groups for batch_size / gpus prompts.",
    )
    nodes: int = Field(
        1, ge=1, le=64,
        description="Machines the job spans, each giving `gpus` training processes. Above 1 the job runs on the "
        "operator's Ray cluster (as with backend 'ray'): nodes x gpus processes, one FSDP2 group across them.",
    )
    backend: Literal["local", "ray"] = Field(
        "local", description="'local': the worker that claims the job runs it on its own GPUs (torchrun above 1 "
        "GPU). 'ray': that worker drives it on the Ray cluster at CISPO_RAY_ADDRESS (needs the `ray` extra).",
    )

    @property
    def on_ray(self) -> bool:
        """Whether the job runs on the Ray cluster: asked for, or larger than one machine."""
        return self.backend == "ray" or self.nodes > 1

    @property
    def processes(self) -> int:
        """Training processes in the job's group (its world size)."""
        return self.nodes * self.gpus


class JobSpec(Strict):
    """A whole fine-tuning job: CISPO (the default), or supervised (a warm start to continue with CISPO)."""

    method: Literal["cispo", "supervised"] = Field(
        "cispo", description="'cispo': reinforcement from a reward or environment; 'supervised': token-mean "
        "cross-entropy on the assistant turns of chat rows (worker/trainer/supervised.py); a reward, if given, "
        "scores its evaluations.")
    model: str = Field(min_length=1, description="Hub id or local directory of a causal LM.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = Field(0, ge=0, le=2**32 - 1)
    data: DataSpec
    reward: Reward | None = Field(None, description="Scores the completion; give this or environment.")
    environment: EnvironmentSpec | None = Field(None, description="Multi-turn environment; give this or reward.")
    lora: LoraSpec | None = Field(
        LoraSpec(), description="LoRA adapter to train; null trains every weight of the model (full fine-tuning)."
    )
    resources: ResourcesSpec = ResourcesSpec()
    sampling: SamplingSpec = SamplingSpec()
    rollout: RolloutSpec = RolloutSpec()
    advantages: AdvantageSpec = AdvantageSpec()
    loss: CispoLossSpec = CispoLossSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: Schedule = ConstantSchedule()
    training: TrainingSpec = TrainingSpec()
    init_from: str | None = Field(
        None, description="Warm start: a checkpoint whose adapter starts the policy and becomes the reference."
    )
    integrations: Integrations = Field([], description="Experiment trackers the worker logs metrics to.")

    @model_validator(mode="before")
    @classmethod
    def _stale_batches_masked(cls, data):
        """A job with rollout.max_staleness > 0 whose loss names no off_policy_mask gets STALE_BATCH_MASK (an
        explicit null keeps none). Decided here, so the stored spec shows the mask the worker applies."""
        if not isinstance(data, dict):
            return data
        rollout = data.get("rollout")
        staleness = rollout.max_staleness if isinstance(rollout, RolloutSpec) else \
            rollout.get("max_staleness") if isinstance(rollout, dict) else None
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness <= 0:
            return data  # synchronous, or a value the field refuses with its own message
        loss = data.get("loss", {})
        if isinstance(loss, dict) and "off_policy_mask" not in loss:
            return {**data, "loss": {**loss, "off_policy_mask": STALE_BATCH_MASK}}
        if isinstance(loss, CispoLossSpec) and "off_policy_mask" not in loss.model_fields_set:
            mask = OffPolicyMaskSpec(**STALE_BATCH_MASK)
            return {**data, "loss": loss.model_copy(update={"off_policy_mask": mask})}
        return data

    @field_validator("dtype")
    @classmethod
    def _no_float16_training(cls, value: str) -> str:
        return refuse_float16_training(value)

    @model_validator(mode="after")
    def _one_feedback(self) -> JobSpec:
        if self.method == "supervised":
            if self.environment is not None:
                raise ValueError("a supervised job learns from its rows' assistant turns; leave environment out")
            if self.resources.processes > 1:
                raise ValueError("a supervised job trains in one process: set resources.gpus and resources.nodes "
                                 "to 1")
            return self
        if (self.reward is None) == (self.environment is None):
            raise ValueError("give exactly one of reward (scores a single completion) or environment (multi-turn)")
        if self.reward is not None and self.training.max_turns > 1:
            raise ValueError(f"training.max_turns is {self.training.max_turns}, but a reward function scores a "
                             "single turn; more turns need an environment")
        return self

    @model_validator(mode="after")
    def _shares_fit(self) -> JobSpec:
        processes, tc = self.resources.processes, self.training
        name = "resources.gpus" if self.resources.nodes == 1 else "resources.nodes x resources.gpus"
        if tc.batch_size % processes:
            raise ValueError(f"{name} ({processes}) must divide training.batch_size ({tc.batch_size}): "
                             "each process generates whole groups for an equal share of the prompts")
        per_process = tc.batch_size // processes * tc.group_size
        if tc.mini_batches > per_process:
            raise ValueError(f"training.mini_batches ({tc.mini_batches}) exceeds the sequences per process "
                             f"(batch_size / {name} * group_size = {per_process})")
        return self

    @model_validator(mode="after")
    def _recipe_knobs_fit(self) -> JobSpec:
        if self.advantages.scale == "batch_std" and self.advantages.per_turn:
            raise ValueError("advantages.scale 'batch_std' is not supported with advantages.per_turn: use "
                             "'none' or 'group_std' for per-turn advantages")
        if self.training.lm_head_float32 and self.resources.processes > 1:
            raise ValueError("training.lm_head_float32 runs in one process: with resources.gpus > 1 FSDP casts the "
                             "head's weights to the compute dtype itself")
        if self.training.pack_tokens is not None:
            if self.training.pack_tokens < self.sampling.max_model_len:
                raise ValueError(f"training.pack_tokens ({self.training.pack_tokens}) must be at least "
                                 f"sampling.max_model_len ({self.sampling.max_model_len}): a packed row holds "
                                 "whole sequences")
            if self.method != "cispo":
                raise ValueError("training.pack_tokens packs the CISPO update: a supervised job (method "
                                 "'supervised') trains on padded micro-batches; leave it out")
        if self.lora is not None and self.lora.base_quantization != "none":
            if self.rollout.engine != "hf" or self.resources.processes > 1:
                raise ValueError("lora.base_quantization 'nf4' runs with rollout.engine 'hf' and resources.gpus 1 "
                                 "(vLLM and FSDP are not given the 4-bit base)")
        return self

    @model_validator(mode="after")
    def _merge_needs_an_adapter(self) -> JobSpec:
        if self.training.export == "merged" and self.lora is None:
            raise ValueError("training.export 'merged' merges a LoRA adapter into its base, but this job trains the "
                             "whole model (lora: null): its checkpoints' model/ loads with from_pretrained as it is")
        return self

    @model_validator(mode="after")
    def _vllm_in_one_process(self) -> JobSpec:
        # The in-process vLLM engine would be handed each rank's FSDP shards and meet the trainer's process
        # group; it needs a process of its own: on Ray the sampler actor of asynchronous rollouts
        # (worker/ray_driver/sampler_actor.py), which a synchronous job does not start.
        if self.rollout.engine != "vllm":
            return self
        if self.resources.on_ray:
            if self.rollout.max_staleness == 0:
                raise ValueError(f"rollout.engine 'vllm' on Ray (resources.nodes {self.resources.nodes}, backend "
                                 f"{self.resources.backend!r}) runs in the sampler actor of asynchronous rollouts, "
                                 "but rollout.max_staleness is 0: set rollout.max_staleness to 1 or more, or "
                                 "rollout.engine to 'hf'")
        elif self.resources.processes > 1:
            raise ValueError(f"rollout.engine 'vllm' runs in one training process, but resources.gpus is "
                             f"{self.resources.gpus}: set resources.gpus to 1 (or run on Ray with "
                             "rollout.max_staleness 1 or more), or rollout.engine to 'hf'")
        return self

