"""How a job samples: the sampling knobs and the rollout engine (with its log-prob correction and staleness)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from service.job_spec.strict import Strict


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
    version_policy: Literal["newest", "fixed_lag"] = Field(
        "newest",
        description="With max_staleness > 0, which policy version samples each batch. 'newest': the newest the "
        "sampler holds when it starts the batch (freshest; timing decides, so two runs of one spec may sample "
        "differently). 'fixed_lag': the batch of step j with exactly version max(start, j - max_staleness), the "
        "weights sent before its request, so a run samples the same whatever the timing (reproducible, always "
        "at the staleness bound).",
    )

    @model_validator(mode="after")
    def _cap_not_below_one(self) -> RolloutSpec:
        if self.tis_cap and self.tis_cap < 1.0:
            raise ValueError(f"tis_cap ({self.tis_cap}) must be null or 0 (off), or at least 1: a cap below 1 "
                             "would scale down every token the trainer and sampler agree on")
        return self
