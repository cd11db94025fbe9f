"""The engine's request and result values (see worker/engine/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass(frozen=True)
class AdapterConfig:
    """A LoRA adapter on the resident base, as Tinker's LoraConfig names it."""

    rank: int
    seed: int | None = None  # the adapter's initialisation (None: torch's global RNG)
    train_attn: bool = True  # q, k, v, o projections
    train_mlp: bool = True  # gate, up, down projections
    train_unembed: bool = False  # the LM head (refused where the base ties it to the embeddings)
    alpha: float | None = None  # None: 2 * rank, as the job spec's default scale of 2


@dataclass(frozen=True)
class Datum:
    """One sequence: model input tokens and, per input position t, the loss inputs of predicting targets[t].

    `inputs` holds 1-D tensors of len(tokens): "target_tokens" (int64, required), and as the loss needs them
    "weights", "logprobs" (the sampler's, float32), "advantages" (float32), "clip_low_threshold",
    "clip_high_threshold"."""

    tokens: list[int]
    inputs: dict[str, Tensor]


@dataclass(frozen=True)
class Pass:
    """One adapter's forward (and, unless forward_only, backward) over its datums."""

    adapter: str
    datums: list[Datum]
    loss: str  # "cross_entropy" | "importance_sampling" | "ppo" | "cispo"
    config: dict[str, float] = field(default_factory=dict)  # the loss's knobs (clip thresholds, ...)
    forward_only: bool = False


@dataclass
class PassResult:
    logprobs: list[Tensor]  # per datum, float32, len(tokens): log p(target_tokens[t] | tokens[:t+1])
    metrics: dict[str, float]  # "name:reduction" keys (reduction: sum, mean, min, max), e.g. "loss:sum"


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


@dataclass(frozen=True)
class SampleParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    stop: tuple = ()  # token ids (ints) or strings; a sequence ends after the first it produces
    seed: int | None = None


@dataclass(frozen=True)
class Draw:
    """num_samples continuations of one prompt, from an adapter's live weights, a sampler version
    (save_weights_for_sampler), or the base alone (source None)."""

    source: str | None
    prompt: list[int]
    num_samples: int
    params: SampleParams
    prompt_logprobs: bool = False


@dataclass
class Sequence:
    tokens: list[int]  # the new tokens, up to and including the EOS, stop token or stop string's last token
    logprobs: list[float]  # the sampler's, per new token: log softmax(logits / T) (T = 1 when greedy), see draws.py
    stop_reason: str  # "stop" (EOS or a stop sequence) | "length"


@dataclass
class DrawResult:
    sequences: list[Sequence]
    # with Draw.prompt_logprobs: [None] + log p(prompt[t] | prompt[:t]) for t >= 1, the model's own (temperature 1)
    prompt_logprobs: list[float | None] | None = None
    # why this draw alone failed (its rows gave NaN or inf logits), sequences then empty; the call's other draws
    # are served (a sample call batches the draws of many clients)
    error: str | None = None
