"""The job spec: the one validated object that the API accepts and the worker runs.

Torch-free on purpose, so the API process can validate a job without CUDA.
Every field has a default, a bound and an error that names it; unknown fields
are refused. Choices with their own knobs (schedule, reward, environment) are
discriminated unions on a ``type`` field.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.schemas.environments import EnvironmentSpec
from service.schemas.recipe import OffPolicyMaskSpec, PassRateFilterSpec
from service.schemas.integrations import Integrations
from service.schemas.rewards import AnyReward
from service.schemas.stopping import StopWhenSpec


def refuse_float16_training(value: str | None) -> str | None:
    """The training dtype: float16 is refused, since there is no loss scaling (gradients of a loss averaged over
    ~10^4 tokens underflow in float16). rollout.dtype may still be float16: sampling has no gradients."""
    if value == "float16":
        raise ValueError("float16 training is not supported (no loss scaling: gradients underflow); use "
                         "bfloat16, or float32 on a GPU without bfloat16 ('auto' picks for you)")
    return value


class Strict(BaseModel):
    """Base for every spec section: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


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


class SamplingSpec(Strict):
    """Rollout sampling; the trainer scores tokens at the same temperature."""

    temperature: float = Field(1.0, gt=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    max_output_tokens: int = Field(256, ge=1, le=131072)
    min_output_tokens: int = Field(
        0, ge=0, le=131072,
        description="EOS is suppressed until a completion (each turn) has this many tokens; 0: no minimum.",
    )
    max_model_len: int = Field(1024, ge=2, le=1048576, description="Prompt plus completion, in tokens.")

    @model_validator(mode="after")
    def _lengths(self) -> SamplingSpec:
        if self.max_output_tokens >= self.max_model_len:
            raise ValueError(
                f"max_output_tokens ({self.max_output_tokens}) must be smaller than "
                f"max_model_len ({self.max_model_len}), which also holds the prompt"
            )
        if self.min_output_tokens > self.max_output_tokens:
            raise ValueError(f"min_output_tokens ({self.min_output_tokens}) exceeds max_output_tokens "
                             f"({self.max_output_tokens})")
        return self


class RolloutSpec(Strict):
    """Which engine samples the rollouts, and the correction for its log-prob mismatch with the trainer.

    'hf' generates inside the trainer's own model (worker/rollout/decode.py). 'vllm' runs a
    vLLM engine in the worker (the optional `vllm` extra): the LoRA adapter is
    hot-loaded each step, and its sampling log-probs feed the truncated
    importance-sampling (TIS) correction.
    """

    engine: Literal["hf", "vllm"] = Field("hf", description="'hf' (transformers) or 'vllm'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Precision the rollouts sample in; 'auto': the model's. Sampling below the training precision "
        "(e.g. bfloat16 for a float32 job: 2-3x faster matmuls on CPUs with AVX512-BF16, half the memory traffic) "
        "makes the sampler's log-probs differ slightly from the trainer's; the engine then reports them and the "
        "truncated IS correction (tis_cap) weighs each token, as with vllm.",
    )
    gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=0.95,
        description="vllm on GPU: share of GPU memory for weights and KV cache; the trainer needs the rest.",
    )
    sleep_mode: bool = Field(
        True, description="vllm on GPU: free the engine's GPU memory while the trainer updates (ignored on CPU)."
    )
    tis_cap: float | None = Field(
        2.0, ge=0.0, le=100.0,
        description="Truncated IS weight min(exp(logp_old - logp_sampler), tis_cap) on each policy-gradient term, "
        "when the engine reports log-probs (vllm); null or 0 disables it. 2.0 as in AgileRL.",
    )
    max_staleness: int = Field(
        0, ge=0, le=8,
        description="Asynchronous rollouts: a sampler process produces the batches of the next max_staleness steps "
        "while the trainer updates, and no sample more than max_staleness policy versions old is trained on; "
        "CISPO's ratio is then taken against the sampler's own log-probs. 0: the synchronous loop.",
    )

    @model_validator(mode="after")
    def _cap_not_below_one(self) -> RolloutSpec:
        if self.tis_cap and self.tis_cap < 1.0:
            raise ValueError(f"tis_cap ({self.tis_cap}) must be null or 0 (off), or at least 1: a cap below 1 "
                             "would scale down every token the trainer and sampler agree on")
        return self


class AdvantageSpec(Strict):
    """Group-relative advantages (MiniMax-M1 Eq. 2; mean-only as in Dr.GRPO and AgileRL)."""

    scale: Literal["none", "group_std", "batch_std"] = Field(
        "none", description="'none': A = r - mean(group); 'group_std': divide by std(group) + eps; 'batch_std' "
        "(ScaleRL): divide by the std of every reward of the step's batch + eps."
    )
    eps: float = Field(1e-6, gt=0.0)
    clip: float | None = Field(None, gt=0.0, description="Clip advantages to [-clip, clip].")
    drop_zero_groups: bool = Field(
        False, description="Leave out groups whose rewards are all equal (they carry no signal)."
    )
    per_turn: bool = Field(
        False,
        description="Environments: each turn's actions get the group-relative advantage of their reward-to-go "
        "(the sum of the rewards from that turn on), compared within the group at the same turn index. "
        "Off: every action token gets the episode's advantage (episode reward = sum of turn rewards).",
    )


class CispoLossSpec(Strict):
    """CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 3-5).

    ratio_max is an absolute cap on the detached importance weight, with no
    lower bound. Default 5.0: ScaleRL (arXiv 2510.13786) found 4-8 equally
    good and TRL's docs recommend 5.0 for loss_type="cispo".
    """

    type: Literal["cispo"] = "cispo"
    ratio_max: float = Field(5.0, ge=1.0, le=100.0)
    normalization: Literal["token", "sequence", "prompt"] = Field(
        "token",
        description="'token': divide by all action tokens of the optimizer step (the paper); "
        "'sequence': mean over tokens, then over sequences; 'prompt' (ScaleRL): mean over the tokens of each "
        "prompt's completions in the optimizer step, then over prompts.",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="'token': each token's ratio exp(logp - logp_old); 'sequence' (GSPO): every token of a "
        "sequence gets exp(mean over its action tokens of logp - logp_old). Capped at ratio_max either way.",
    )
    off_policy_mask: OffPolicyMaskSpec | None = Field(
        None, description="AgileRL's token and sequence masks for off-policy tokens; null: none."
    )
    kl_beta: float = Field(0.0, ge=0.0, description="Weight of the k3 KL penalty to the reference.")
    kl_clamp: float = Field(10.0, gt=0.0, description="Per-token cap on the k3 KL estimate.")

    @model_validator(mode="after")
    def _warn_low_cap(self) -> CispoLossSpec:
        if self.ratio_max < 2.0:
            warnings.warn(
                f"loss.ratio_max={self.ratio_max} is below 2: the cap will bind on most "
                "off-policy tokens; later work uses 4-8",
                UserWarning,
                stacklevel=2,
            )
        return self


class OptimizerSpec(Strict):
    """AdamW. Betas and eps default to the MiniMax-M1 paper (section 3.2)."""

    lr: float = Field(1e-5, gt=0.0, le=1.0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-15, gt=0.0, le=1e-3)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="None disables clipping.")

    @model_validator(mode="after")
    def _betas(self) -> OptimizerSpec:
        for i, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}]={b} must be in [0, 1)")
        return self


class ConstantSchedule(Strict):
    type: Literal["constant"] = "constant"
    warmup_steps: int = Field(0, ge=0)


class CosineSchedule(Strict):
    type: Literal["cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)


Schedule = Annotated[ConstantSchedule | CosineSchedule, Field(discriminator="type")]


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
        # group; it needs GPUs of its own (a separate sampler), which the service does not give it yet.
        if self.rollout.engine == "vllm" and (self.resources.processes > 1 or self.resources.on_ray):
            raise ValueError(f"rollout.engine 'vllm' runs in one training process, but resources.gpus is "
                             f"{self.resources.gpus} (nodes {self.resources.nodes}, backend "
                             f"{self.resources.backend!r}): set resources.gpus and nodes to 1 and backend 'local', "
                             "or rollout.engine to 'hf'")
        return self

    @model_validator(mode="after")
    def _asynchronous_scope(self) -> JobSpec:
        # The sampler process runs our decode loop (and an environment's episodes) on one device; the vLLM and
        # multi-process (FSDP) samplers are not split off yet.
        if self.rollout.max_staleness == 0:
            return self
        unsupported = [why for why, bad in (
            ("rollout.engine is 'vllm' (needs 'hf')", self.rollout.engine != "hf"),
            (f"resources.gpus is {self.resources.gpus} (needs 1)", self.resources.gpus > 1),
            ("the job runs on Ray (needs resources.backend 'local' and nodes 1)", self.resources.on_ray),
        ) if bad]
        if unsupported:
            raise ValueError(f"rollout.max_staleness ({self.rollout.max_staleness}) > 0 is not supported when "
                             f"{'; '.join(unsupported)}: set rollout.max_staleness to 0")
        return self
