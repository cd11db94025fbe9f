"""Rollouts on a real instruct model (SmolLM2-135M-Instruct): ChatML, its default system prompt, `<|im_end|>` as the
EOS that closes a turn, a 49k byte-level BPE vocabulary.

A multi-turn sequence is built from sampled ids plus environment segments tokenized on their own
(worker/model/turns.py); here it must equal, token for token, the template's own rendering of the conversation
tokenized whole, for an action that ended with `<|im_end|>` and for one cut by max_output_tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.real_model import CAPITAL
from tests.specs import real_spec
from tests.worker.rollout.test_multi_turn import Scripted
from worker.envs.protocol import Outcome
from worker.model.policy import load_policy
from worker.rollout.rollout import generate

ARITHMETIC = [{"role": "user", "content": "What is 7 + 5?"}]


@pytest.fixture(scope="module")
def policy(real_model_dir):
    torch.manual_seed(0)
    return load_policy(real_spec(real_model_dir), resume_from=None, warm_start=None)


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    edges = [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]] + ([len(mask)] if mask[-1] else [])
    starts = [i for i in edges if mask[i - 1] == 0 and i < len(mask) and mask[i]]
    return [(s, next(e for e in edges if e > s)) for s in starts]


def test_a_chat_completion_ends_with_im_end_and_its_text_has_no_special_token(policy, real_model_dir):
    tok = policy.tokenizer
    assert tok.eos_token == "<|im_end|>"
    spec = real_spec(real_model_dir, sampling={"max_output_tokens": 12})
    rollout = generate(policy, [{"messages": CAPITAL}, {"messages": ARITHMETIC}], spec.sampling, group_size=1,
                       greedy=True)
    prompt = tok.decode(rollout.token_ids[0][:rollout.prompt_lengths[0]])
    assert prompt.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    capital, arithmetic = rollout.token_ids
    assert capital[-1] == tok.eos_token_id and rollout.action_mask[0][-1] == 1  # the EOS is an action: trained
    assert rollout.completions[0] == "The capital of France is Paris."
    assert not rollout.truncated[0]
    # The arithmetic answer rambles past 12 tokens: cut there, no EOS.
    assert tok.eos_token_id not in arithmetic[rollout.prompt_lengths[1]:]
    assert rollout.truncated[1] and rollout.action_counts[1] == 12
    assert "<|im" not in rollout.completions[1]


def _two_turns(turn, action, row):
    if turn == 1:
        return Outcome(observation="And of Italy?", reward=0.5)
    return Outcome(reward=1.0, terminated=True)


@pytest.mark.parametrize("max_output_tokens", [12, 4], ids=["ended-by-im-end", "cut-by-max-tokens"])
def test_environment_turns_equal_the_templates_rendering_token_for_token(policy, real_model_dir, max_output_tokens):
    tok = policy.tokenizer
    spec = real_spec(real_model_dir, sampling={"max_output_tokens": max_output_tokens, "max_model_len": 160})
    env = Scripted(_two_turns, first=CAPITAL[0]["content"])
    rollout = generate(policy, [{}], spec.sampling, group_size=1, greedy=True, environment=env, max_turns=2)
    ids, mask = rollout.token_ids[0], rollout.action_mask[0]
    assert rollout.turns == [2]
    (first_start, first_end), (second_start, second_end) = _runs(mask)
    first = ids[first_start:first_end]
    assert (first[-1] == tok.eos_token_id) == (max_output_tokens == 12)
    action_text = tok.decode(first, skip_special_tokens=True)
    assert tok(action_text, add_special_tokens=False)["input_ids"] == [t for t in first if t != tok.eos_token_id], \
        "the greedy action is not its text's own tokenization: the comparison below would not be about the turns"
    conversation = [*CAPITAL, {"role": "assistant", "content": action_text},
                    {"role": "user", "content": "And of Italy?"}]
    rendered = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert ids[:second_start] == tok(rendered, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids[first_end:second_start]).endswith(
        "<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n")
    assert second_end == len(ids)
