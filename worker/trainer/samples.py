"""A few of a step's completions, picked for people to read (the API's /samples).

Per group, the best and the worst completion by reward (the contrast the
advantage is made of; one when all score the same), for the step's first
``groups`` groups (8: every group of the default batch_size; under several
processes, the first process's groups), so at most 16 samples per step. Text is cut to ``max_chars`` so a long rollout cannot bloat the
database. The prompt is what the model saw (the chat template applied); for
an environment job the completion is the whole episode after the prompt,
environment turns included.
"""

from __future__ import annotations

import math

from torch import Tensor

from worker.trainer.feedback import Feedback
from worker.rollout.rollout import Rollout

SAMPLE_GROUPS_PER_STEP = 8
MAX_SAMPLE_CHARS = 4000


def _cut(text: str, max_chars: int) -> str:
    text = text.replace("\x00", "\ufffd")  # PostgreSQL text cannot hold NUL
    return text if len(text) <= max_chars else text[: max_chars - 1] + "\u2026"


def _number(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def pick_indices(rewards: list[float], group_size: int, groups: int) -> list[int]:
    """Sequence indices: each of the first `groups` groups' best then worst (one if they are the same).
    A non-finite reward ranks lowest."""
    ranked = [r if math.isfinite(r) else -math.inf for r in rewards]
    picked: list[int] = []
    for start in range(0, min(len(rewards), groups * group_size), group_size):
        group = range(start, min(start + group_size, len(rewards)))
        best = max(group, key=lambda i: ranked[i])
        worst = min(group, key=lambda i: ranked[i])
        picked.extend(dict.fromkeys((best, worst)))
    return picked


def prompt_text(tokenizer, ids: list[int]) -> str:
    """The prompt as a person reads it: without the tokens the tokenizer itself puts in front (the toy's `<s>`,
    raw in the dashboard), but with every token of a chat template, which is what the model saw, also where the
    template's role markers are the BOS or pad token (ChatML's <|im_start|> is SmolLM2's BOS, <|im_end|> its pad)."""
    added = tokenizer("")["input_ids"]
    if added and ids[:len(added)] == added:
        ids = ids[len(added):]
    return tokenizer.decode(ids)


def pick_samples(tokenizer, rollout: Rollout, feedback: Feedback, advantages_PG: Tensor, group_size: int, *,
                 multi_turn: bool, groups: int = SAMPLE_GROUPS_PER_STEP,
                 max_chars: int = MAX_SAMPLE_CHARS) -> list[dict]:
    rewards = feedback.rewards.tolist()
    advantages = advantages_PG.flatten().tolist()
    components = feedback.scores.components if feedback.scores is not None else {}
    samples = []
    for i in pick_indices(rewards, group_size, groups):
        ids, start = rollout.token_ids[i], rollout.prompt_lengths[i]
        completion = tokenizer.decode(ids[start:]) if multi_turn else rollout.completions[i]
        if components:
            parts = {name: values[i] for name, values in components.items()}
        elif multi_turn:
            parts = {f"turn_{t + 1}": r for t, r in enumerate(feedback.turn_rewards[i])}
        else:
            parts = {}
        samples.append({
            "prompt": _cut(prompt_text(tokenizer, ids[:start]), max_chars),
            "completion": _cut(completion, max_chars),
            "reward": _number(rewards[i]),
            "advantage": _number(advantages[i]),
            "rewards": {k: _number(v) if v is not None else None for k, v in parts.items()},
        })
    return samples
