"""Rollouts: group_size episodes per prompt, one or more turns each, sampled by worker/rollout/decode.py.

One path for both kinds of job. Without an environment an episode is one
assistant turn after the row's prompt (the reward function then scores the
completion). With one, an episode starts from reset's observation (or the
row's prompt), and each turn the assistant's text goes to env.step, whose
observation is appended as the next user turn, until the environment ends
the episode, max_turns is reached, or the next turn would not fit in
max_model_len. Generation is batched across the episodes still running.

Each sequence keeps its full token ids and an action mask: 1 on the ids the
policy generated (kept verbatim, never re-tokenized), 0 on the prompt and on
environment turns, which therefore never get a gradient.

The sampling itself is pluggable: ``sampler`` (a rollout engine's, see
worker/rollout/; by default the policy's own model through
worker/rollout/decode.py) samples every turn and may
return the sampler's log-prob of each generated token, kept per sequence in
``sampler_logprobs`` (aligned with the action tokens).

Random streams: each row (prompt) comes with a sampling seed
(``sampling_seeds``; the trainer derives it from the job seed, the step and
the prompt's index in the whole batch), and each turn of each of its
completions samples from a stream of its own, seeded from that seed, the
completion's index in the group and the turn (worker/model/streams.py). So
a completion's tokens do not depend on which other rows share the batch.

``truncated`` flags an episode cut by a length limit: a turn that reached its
token budget (max_output_tokens, or what is left of max_model_len) without
EOS, or an environment turn that would not fit. A turn cut by
max_output_tokens still goes to the environment, which decides what it is
worth; an environment failure ends that episode only (``errors``).

Prompts: without an environment a string prompt is tokenized as is
(completion style, as single-turn jobs always were) and a message list goes
through the chat template; with one, every observation is a chat turn.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch

from service.schemas.dataset import row_prompt
from service.job_spec.sampling import SamplingSpec
from worker.envs.protocol import Environment
from worker.rollout.decode import sample_tokens
from worker.rollout.effective_weights import rollout_weights
from worker.rollout.packed_linears import PACK_MIN_NEW_TOKENS
from worker.model.policy import Policy
from worker.model.streams import stream_seed
from worker.model.turns import as_messages, chat_ids, encode_prompt, environment_turn_ids, first_messages

__all__ = ["Rollout", "TokenSampler", "TurnRequest", "generate", "rollout_turns", "TransformersSampler",
           "encode_prompt"]


class TokenSampler(Protocol):
    def __call__(self, seqs: list[list[int]], budgets: list[int], *, greedy: bool,
                 seeds: list[int] | None = None) -> tuple[list[list[int]], list[list[float]] | None]:
        """New ids per sequence (at most its budget, ending with EOS when it ended), and their log-probs if known.

        `seeds`: one per sequence, the seed of the stream its tokens are drawn from (None when greedy)."""


@dataclass
class Rollout:
    """One rollout batch; sequence i belongs to prompt i // group_size."""

    rows: list[dict]  # per sequence
    token_ids: list[list[int]]  # prompt, actions and environment turns, in order
    action_mask: list[list[int]]  # 1 where the policy generated the token
    action_turns: list[list[int]]  # the turn index of each action token, in order
    prompt_lengths: list[int]
    completions: list[str]  # the last action's text (what a reward function scores)
    truncated: list[bool]
    turns: list[int]  # assistant turns taken
    turn_rewards: list[list[float]] = field(default_factory=list)  # environment rewards, per turn
    errors: list[str | None] = field(default_factory=list)  # an environment failure ended the episode
    sampler_logprobs: list[list[float]] | None = None  # per action token, when the sampler reported them

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def action_counts(self) -> list[int]:
        return [len(t) for t in self.action_turns]


class _Episode:
    def __init__(self, row: dict, episode_id: str, prompt: int, copy: int):
        self.row, self.id = row, episode_id
        self.prompt, self.copy = prompt, copy  # the row's index in the batch, the completion's in its group
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.action_turns: list[int] = []
        self.sampler_logprobs: list[float] = []
        self.history: list[dict] = []
        self.prompt_length = 0
        self.completion = ""
        self.truncated = False
        self.turns = 0
        self.rewards: list[float] = []
        self.error: str | None = None
        self.done = False

    def append(self, ids: list[int], *, turn: int | None) -> None:
        self.ids += ids
        self.mask += [0 if turn is None else 1] * len(ids)
        if turn is not None:
            self.action_turns += [turn] * len(ids)

    def fail(self, message: str) -> None:
        self.error, self.done = message, True


class TransformersSampler:
    """A TokenSampler on the policy's own model, by worker/rollout/decode.py: its effective weights (active
    adapters applied), in `dtype` (None: the weights' own), with each token's log-prob when `logprobs`.

    No autocast here: the weights are cast and packed (worker/rollout/effective_weights.py) once per
    `holding()`, not at every decode step. generate() holds them across a rollout's turns, which all sample the
    same weights; a call outside a hold holds them for that call."""

    def __init__(self, policy: Policy, sampling: SamplingSpec, *, dtype: torch.dtype | None = None,
                 logprobs: bool = False):
        self.policy, self.sampling, self.dtype, self.logprobs = policy, sampling, dtype, logprobs
        self._held = False
        self._weights = ExitStack()  # what the first call inside a hold made: released when the hold ends
        self._generator = None

    @contextmanager
    def holding(self):
        """Keep the weights the first call inside makes until the end (that call's token budget decides whether
        packing pays: see PACK_MIN_NEW_TOKENS)."""
        if self._held:  # inside an outer hold
            yield
            return
        self._held = True
        try:
            yield
        finally:
            self._held, self._generator = False, None
            self._weights.close()

    def __call__(self, seqs: list[list[int]], budgets: list[int], *, greedy: bool,
                 seeds: list[int] | None = None):
        with self.holding():
            if self._generator is None:
                model = self.policy.model
                self._weights.callback(model.train, model.training)
                model.eval()
                self._generator = self._weights.enter_context(rollout_weights(
                    model, self.dtype, head_float32=self.policy.lm_head_float32,
                    pack=max(budgets, default=0) >= PACK_MIN_NEW_TOKENS))
            tok = self.policy.tokenizer
            return sample_tokens(self._generator, seqs, max_new=max(budgets), sampling=self.sampling,
                                 greedy=greedy, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                                 device=self.policy.device, compiled=self.policy.device.type == "cuda",
                                 logprobs=self.logprobs, seeds=seeds)


@dataclass
class TurnRequest:
    """What one turn of a rollout asks its sampler for (a TokenSampler's arguments)."""

    seqs: list[list[int]]
    budgets: list[int]
    greedy: bool
    seeds: list[int] | None


def generate(
    policy: Policy,
    rows: list[dict],
    sampling: SamplingSpec,
    *,
    group_size: int,
    greedy: bool = False,
    environment: Environment | None = None,
    max_turns: int = 1,
    seeds: list[int] | None = None,
    sampler: TokenSampler | None = None,
    sampling_seeds: list[int] | None = None,
) -> Rollout:
    """`seeds`: each row's environment reset seed; `sampling_seeds`: each row's sampling seed (see the module
    docstring; None: drawn from torch's global RNG)."""
    sampler = sampler or TransformersSampler(policy, sampling, dtype=policy.compute_dtype)
    turns = rollout_turns(policy.tokenizer, rows, sampling, group_size=group_size, greedy=greedy,
                          environment=environment, max_turns=max_turns, seeds=seeds, sampling_seeds=sampling_seeds)
    try:
        with getattr(sampler, "holding", nullcontext)():  # the same weights for every turn: made once
            request = next(turns)
            while True:
                request = turns.send(sampler(request.seqs, request.budgets, greedy=request.greedy,
                                             seeds=request.seeds))
    except StopIteration as done:
        return done.value


def rollout_turns(
    tok,
    rows: list[dict],
    sampling: SamplingSpec,
    *,
    group_size: int,
    greedy: bool = False,
    environment: Environment | None = None,
    max_turns: int = 1,
    seeds: list[int] | None = None,
    sampling_seeds: list[int] | None = None,
) -> Generator[TurnRequest, tuple[list[list[int]], list[list[float]] | None], Rollout]:
    """generate() as a generator driven by its caller: it yields each turn's TurnRequest, is sent the sampler's
    answer, and returns the Rollout. The environment's reset, step and release calls run inside it, once each,
    so a caller may sample several rollouts' turns together (worker/multi/rollout.py)."""
    copies = 1 if greedy else group_size
    if not greedy and sampling_seeds is None:
        sampling_seeds = torch.randint(0, 2**62, (len(rows),)).tolist()
    tag = uuid.uuid4().hex[:12]
    episodes = [_Episode(row, f"{tag}-{i * copies + c}", i, c) for i, row in enumerate(rows) for c in range(copies)]

    if environment is None:
        prompts = [encode_prompt(tok, row_prompt(row)) for row in rows]  # once per prompt, not per copy
        for ep in episodes:
            ep.append(prompts[ep.prompt], turn=None)
    else:
        seeds = seeds or [0] * len(rows)
        outcomes = environment.reset([(ep.id, seeds[i // copies], ep.row) for i, ep in enumerate(episodes)])
        for ep, outcome in zip(episodes, outcomes, strict=True):
            if outcome.error is not None:
                ep.fail(f"reset: {outcome.error}")
                continue
            try:
                ep.history = first_messages(outcome.observation, ep.row)
            except ValueError as e:
                ep.fail(f"reset: {e}")
                continue
            ep.append(chat_ids(tok, ep.history), turn=None)  # a template that cannot render fails the job
    for ep in episodes:
        ep.prompt_length = len(ep.ids)
    longest = max((len(ep.ids) for ep in episodes if not ep.done), default=0)
    if longest and min(sampling.max_output_tokens, sampling.max_model_len - longest) < 1:
        raise ValueError(
            f"a prompt of {longest} tokens leaves no room for output within max_model_len={sampling.max_model_len}"
        )

    turns = max_turns if environment is not None else 1
    reported = False  # whether the sampler gave log-probs
    for turn in range(turns):
        active = [ep for ep in episodes if not ep.done]
        if not active:
            break
        budgets = [min(sampling.max_output_tokens, sampling.max_model_len - len(ep.ids)) for ep in active]
        streams = None if greedy else [stream_seed("sample", sampling_seeds[ep.prompt], ep.copy, turn) for ep in active]
        generated, logprobs = yield TurnRequest([ep.ids for ep in active], budgets, greedy, streams)
        reported = logprobs is not None
        eos = tok.eos_token_id  # read once: a tokenizer attribute costs microseconds a read, per row adds up
        for j, (ep, new, budget) in enumerate(zip(active, generated, budgets)):
            ended = eos in new[:budget]
            action = new[: new.index(eos) + 1] if ended else new[:budget]
            ep.append(action, turn=turn)
            if logprobs is not None:
                ep.sampler_logprobs += logprobs[j][: len(action)]
            ep.truncated |= not ended
            ep.turns = turn + 1
            ep.completion = tok.decode(action, skip_special_tokens=True)
            ep.history = ep.history + [{"role": "assistant", "content": ep.completion}]
        if environment is None:
            break
        outcomes = environment.step([(ep.id, ep.completion) for ep in active])
        for ep, outcome in zip(active, outcomes, strict=True):
            _advance(tok, ep, outcome, last_turn=turn == turns - 1, max_model_len=sampling.max_model_len)
    if environment is not None:
        environment.release([ep.id for ep in episodes])

    return Rollout(
        rows=[ep.row for ep in episodes],
        token_ids=[ep.ids for ep in episodes],
        action_mask=[ep.mask for ep in episodes],
        action_turns=[ep.action_turns for ep in episodes],
        prompt_lengths=[ep.prompt_length for ep in episodes],
        completions=[ep.completion for ep in episodes],
        truncated=[ep.truncated for ep in episodes],
        turns=[ep.turns for ep in episodes],
        turn_rewards=[ep.rewards for ep in episodes] if environment is not None else [],
        errors=[ep.error for ep in episodes] if environment is not None else [],
        sampler_logprobs=[ep.sampler_logprobs for ep in episodes] if reported else None,
    )


def _advance(tok, ep: _Episode, outcome, *, last_turn: bool, max_model_len: int) -> None:
    """Apply one step's outcome: record the reward, then end the episode or append the observation turn."""
    if outcome.error is not None:
        ep.fail(f"step {ep.turns}: {outcome.error}")
        return
    ep.rewards.append(outcome.reward)
    if outcome.terminated or outcome.truncated or last_turn:
        ep.done = True
        return
    observation = as_messages(outcome.observation)
    segment = environment_turn_ids(tok, ep.history, observation,
                                   action_ended_with_eos=bool(ep.ids) and ep.ids[-1] == tok.eos_token_id)
    if len(ep.ids) + len(segment) + 1 > max_model_len:  # no room for even one more generated token
        ep.truncated, ep.done = True, True
        return
    ep.append(segment, turn=None)
    ep.history = ep.history + observation
