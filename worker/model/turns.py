"""Token bookkeeping for chat turns: what to append to a sequence, and never a re-tokenized action.

A multi-turn sequence is built incrementally: the first prompt's ids, then
the ids the policy generated (verbatim), then only the template text that
closes the assistant turn and opens the next one around the environment's
observation, tokenized on its own. Re-tokenizing the whole conversation
would not reproduce the sampled ids (tokenizers merge across boundaries,
templates rewrite assistant text), and the trainer must score exactly the
ids it sampled.

The environment segment is found by rendering the chat template twice with
a sentinel in place of the last assistant message: the conversation up to
and including that message, and the same plus the observation with the
generation prompt. The second must extend the first (templates that render
turn by turn do); the difference, plus whatever follows the sentinel in the
first rendering (the assistant turn's closing text), is the new segment. If
the action ended with EOS and the closing text starts with the EOS token
(ChatML's <|im_end|>), that token is not added twice.
"""

from __future__ import annotations

from service.schemas.dataset import row_problem, row_prompt
from worker.envs.protocol import Observation

SENTINEL = "\u2063CISPO-ACTION\u2063"


def _ids(result) -> list[int]:
    return list(result["input_ids"] if hasattr(result, "keys") else result)


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    """A dataset prompt as a single-turn job sees it: a string as is, a message list through the chat template."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    return chat_ids(tokenizer, prompt)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def as_messages(observation: Observation) -> list[dict]:
    """An observation as chat messages: a string is the next user turn."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    return [dict(m) for m in observation]


def first_messages(observation: Observation | None, row: dict) -> list[dict]:
    """The conversation's start: reset's observation, or the row's prompt when reset gave none."""
    if observation is not None:
        return as_messages(observation)
    if row_problem(row) is not None:
        raise ValueError("reset returned no observation and the row has no usable 'prompt' or 'messages'")
    return as_messages(row_prompt(row))


def _render(tokenizer, messages: list[dict], *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def environment_turn_ids(tokenizer, history: list[dict], observation: list[dict], *,
                         action_ended_with_eos: bool) -> list[int]:
    """Ids to append after an assistant action: the turn's closing text, the observation, the next generation prompt.

    ``history`` is the conversation so far, ending with the assistant message just generated.
    """
    before = history[:-1] + [{"role": "assistant", "content": SENTINEL}]
    closed = _render(tokenizer, before, generation_prompt=False)
    extended = _render(tokenizer, before + observation, generation_prompt=True)
    if not extended.startswith(closed) or SENTINEL not in closed:
        raise ValueError("the chat template does not render conversations turn by turn (adding a turn changes "
                         "the text before it), so environment turns cannot be appended to the generated ids")
    closing = closed[closed.rindex(SENTINEL) + len(SENTINEL):]
    eos = tokenizer.eos_token
    if action_ended_with_eos and eos and closing.startswith(eos):
        closing = closing[len(eos):]
    return tokenizer(closing + extended[len(closed):], add_special_tokens=False)["input_ids"]
