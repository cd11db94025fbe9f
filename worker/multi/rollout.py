"""Rollouts of several jobs sampled together: each job's rollout driven once, its turns decoded with the others'.

Each job's rollout is worker/rollout/rollout.py's `rollout_turns`, the very
code generate() runs for a job alone: a generator that yields what each turn
asks its sampler for (sequences, budgets, streams) and is sent the answer.
Here every job's generator is advanced to its next request, all pending
requests are decoded in one shared decode (worker/rollout/decode.py's
sample_jobs), each job is sent its part, and so on, turn by turn, until
every rollout has returned.
A single-turn job asks once; a multi-turn (environment) job asks once per
turn, its environment's reset, step and release running inside its own
generator, once each, as alone. Jobs with more turns go on decoding together
after the others are done. Jobs with rollout.engine 'vllm' are sampled by
the worker's one vLLM engine instead (worker/multi/vllm_engine.py), all of
them in one generate call per turn, each row with its job's LoRA.
Jobs with a rollout.dtype other than the base's (bfloat16 sampling for
float32 training) decode on copies of the base's weights cast to it, made by
the code a job alone samples with (worker/rollout/effective_weights.py), their
adapters in float32 on them: one decode per sampling precision (a worker's
jobs share one: worker/multi/support.py's base_key).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from service.job_spec.sampling import SamplingSpec
from worker.envs.protocol import Environment
from worker.multi.lora import SharedBase
from worker.rollout.decode import JobRows, sample_jobs
from worker.rollout.effective_weights import rollout_weights
from worker.rollout.packed_linears import PACK_MIN_NEW_TOKENS
from worker.rollout.rollout import Rollout, TurnRequest, rollout_turns


@dataclass
class RolloutRequest:
    """One job's rollout of one cycle."""

    name: str  # its adapter on the shared base
    rows: list[dict]
    sampling: SamplingSpec
    group_size: int
    sampling_seeds: list[int] | None = None
    greedy: bool = False
    environment: Environment | None = None
    max_turns: int = 1
    seeds: list[int] | None = None  # each row's environment reset seed
    engine: str = "hf"  # rollout.engine: our decode loop, or the shared vLLM engine (shared.vllm)
    logprobs: bool = False  # report each token's sampling log-prob even where it does not round (asynchronous jobs)


def _advance(turns, answer=None) -> TurnRequest | Rollout | Exception:
    """Run a job's rollout up to its next request (sending it `answer` to the last one), or to its end."""
    try:
        return next(turns) if answer is None else turns.send(answer)
    except StopIteration as done:
        return done.value
    except Exception as e:  # this job's own problem (a prompt longer than its max_model_len, its environment)
        return e


def generate_jobs(shared: SharedBase, tokenizer, device: torch.device,
                  requests: list[RolloutRequest]) -> list[Rollout | Exception]:
    """Each request's Rollout, in order, or the exception that job's rollout raised (one job's bad prompt,
    environment failure or NaN logits never fails the others)."""
    # The sampler reports log-probs when it rounds: a base held below float32 under float32 adapters.
    logprobs = next(shared.base.parameters()).dtype != torch.float32
    runs = [rollout_turns(tokenizer, req.rows, req.sampling, group_size=req.group_size, greedy=req.greedy,
                          environment=req.environment, max_turns=req.max_turns, seeds=req.seeds,
                          sampling_seeds=req.sampling_seeds) for req in requests]
    state: list[TurnRequest | Rollout | Exception] = [_advance(turns) for turns in runs]
    on_vllm = [i for i, req in enumerate(requests) if req.engine == "vllm" and isinstance(state[i], TurnRequest)]
    try:
        if on_vllm:
            try:
                shared.vllm.prepare(shared, [requests[i].name for i in on_vllm],
                                    max(requests[i].sampling.max_model_len for i in on_vllm))
            except Exception as e:  # the engine's start or an adapter's load: these jobs' problem
                for i in on_vllm:
                    state[i] = e
        while pending := [i for i, s in enumerate(state) if isinstance(s, TurnRequest)]:
            answers = dict(_decode_ours(shared, tokenizer, device, requests, state, logprobs,
                                        [i for i in pending if requests[i].engine != "vllm"]))
            if vllm := [i for i in pending if requests[i].engine == "vllm"]:
                try:
                    answers.update(zip(vllm, shared.vllm.sample(
                        [(requests[i].name, requests[i].sampling, state[i]) for i in vllm])))
                except Exception as e:  # noqa: BLE001 - the engine failed these jobs' turn
                    answers.update((i, e) for i in vllm)
            for i in pending:
                if isinstance(answers[i], Exception):
                    runs[i].close()  # as alone, where the sampler's exception ends generate()
                    state[i] = answers[i]
                else:
                    state[i] = _advance(runs[i], answers[i])
    finally:
        for turns in runs:
            turns.close()
        if on_vllm:
            shared.vllm.rest()
    return state


def _decode_ours(shared: SharedBase, tokenizer, device, requests: list[RolloutRequest], state: list,
                 logprobs: bool, pending: list[int]) -> list[tuple[int, tuple | Exception]]:
    """One turn of the jobs sampled by our decode loop (worker/rollout/decode.py), in one batch per sampling
    precision (one batch on a worker, whose jobs share rollout.dtype: worker/multi/support.py's base_key)."""
    if not pending:
        return []
    groups: dict[tuple, list[int]] = {}
    for i in pending:
        groups.setdefault(_precision(shared, requests[i].name), []).append(i)
    model = shared.model
    was_training = model.training
    shared.set_training(False)
    answers = []
    try:
        for (dtype, head_float32), group in groups.items():
            jobs = [JobRows(requests[i].name, state[i].seqs, max(state[i].budgets), requests[i].sampling,
                            greedy=state[i].greedy, seeds=state[i].seeds,
                            logprobs=logprobs or dtype is not None or requests[i].logprobs)
                    for i in group]
            with _cast(model, dtype, head_float32, max(max(state[i].budgets, default=0) for i in group)):
                answers += zip(group, sample_jobs(model, shared.router, jobs, eos_id=tokenizer.eos_token_id,
                                                  pad_id=tokenizer.pad_token_id, device=device))
    finally:
        shared.set_training(was_training)
    return answers


def _precision(shared: SharedBase, name: str) -> tuple[torch.dtype | None, bool]:
    """(the dtype job `name` samples in where it is not the base's, else None; whether its LM head then runs in
    float32): the jobs decoded together, on the same weights."""
    dtype = shared.rollout_dtypes.get(name)
    return dtype, dtype is not None and name in shared.head_float32


def _cast(model, dtype: torch.dtype | None, head_float32: bool, max_new: int):
    """The base's weights cast to `dtype` (and packed) for the decode, by the code a job alone samples with
    (worker/rollout/effective_weights.py; its adapters in their own dtype, routed as ever), where `dtype` is
    set. A float32 adapter on bfloat16 weights: the rows report their sampling log-probs, as alone."""
    if dtype is None:
        return nullcontext()
    return rollout_weights(model, dtype, head_float32=head_float32, pack=max_new >= PACK_MIN_NEW_TOKENS,
                           adapters=False)
