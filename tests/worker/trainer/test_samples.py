"""The samples a step records for people to read: which ones, and what each shows."""

from __future__ import annotations

import pytest
import torch

from worker.trainer.feedback import Feedback
from worker.trainer.rewards import Scores
from worker.rollout.rollout import Rollout
from worker.trainer.samples import pick_indices, pick_samples


@pytest.fixture(scope="module")
def tok(toy_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_dir / "model")


def _rollout(tok, prompts: list[str], completions: list[str], turns: list[int]) -> Rollout:
    ids = [tok(p)["input_ids"] + tok(c, add_special_tokens=False)["input_ids"] for p, c in zip(prompts, completions)]
    return Rollout(rows=[{}] * len(ids), token_ids=ids, action_mask=[[0] * len(i) for i in ids],
                   action_turns=[[] for _ in ids], prompt_lengths=[len(tok(p)["input_ids"]) for p in prompts],
                   completions=[c[-1:] for c in completions], truncated=[False] * len(ids), turns=turns)


def test_single_turn_samples_carry_reward_parts_and_are_cut(tok):
    rollout = _rollout(tok, ["ab=", "ab=", "cd=", "cd="], ["b", "a\x00", "d" * 50, "c"], [1] * 4)
    rollout.completions = ["b", "a\x00", "d" * 50, "c"]
    scores = Scores(rewards=torch.tensor([1.0, 0.0, float("nan"), 0.5]),
                    components={"exact": [1.0, 0.0, None, 0.5]})
    feedback = Feedback([[1.0], [0.0], [float("nan")], [0.5]], scores=scores)
    advantages_PG = torch.tensor([[0.5, -0.5], [0.0, 0.0]])
    samples = pick_samples(tok, rollout, feedback, advantages_PG, 2, multi_turn=False, max_chars=10)
    assert [s["completion"] for s in samples] == ["b", "a\ufffd", "c", "ddddddddd\u2026"]  # best, worst per group
    assert samples[0] == {"prompt": samples[0]["prompt"], "completion": "b", "reward": 1.0, "advantage": 0.5,
                          "rewards": {"exact": 1.0}}
    assert samples[0]["prompt"] == "ab="  # the tokenizer's BOS (<s>) is not shown
    assert samples[3]["reward"] is None and samples[3]["rewards"] == {"exact": None}  # NaN is not stored


def test_multi_turn_samples_show_the_episode_and_turn_rewards(tok):
    rollout = _rollout(tok, ["ab=", "ab="], ["x?y", "z"], [2, 1])
    feedback = Feedback([[0.25, 1.0], [0.0]])
    samples = pick_samples(tok, rollout, feedback, torch.tensor([[0.6, -0.6]]), 2, multi_turn=True)
    assert [s["completion"] for s in samples] == ["x?y", "z"]  # everything after the prompt, not the last action
    assert samples[0]["rewards"] == {"turn_1": 0.25, "turn_2": 1.0} and samples[0]["reward"] == 1.25


def test_each_group_s_best_and_worst_for_the_first_eight_groups(tok):
    """As documented: every group of the default batch (8 prompts), not a fixed 4 samples per step."""
    n = 10 * 2  # ten groups of two
    rollout = _rollout(tok, ["ab="] * n, [c for g in range(10) for c in ("b", "a")], [1] * n)
    rewards = [r for g in range(10) for r in (0.0, 1.0)]  # each group's best is its second completion
    feedback = Feedback([[r] for r in rewards])
    samples = pick_samples(tok, rollout, feedback, torch.zeros(10, 2), 2, multi_turn=False)
    assert len(samples) == 16 and [s["reward"] for s in samples] == [1.0, 0.0] * 8
    assert pick_indices([1.0] * 8, 4, groups=8) == [0, 4]  # all equal: one per group


def test_a_chatml_prompt_keeps_its_role_markers_though_they_are_the_bos_and_pad_tokens(real_model_dir):
    """SmolLM2's BOS is <|im_start|> and its pad <|im_end|>: the prompt shows them, as the model saw it."""
    from transformers import AutoTokenizer

    from worker.model.turns import chat_ids

    tok = AutoTokenizer.from_pretrained(real_model_dir)
    assert (tok.bos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>")
    prompt = chat_ids(tok, [{"role": "user", "content": "What is the capital of France?"}])
    answer = tok("Paris", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rollout = Rollout(rows=[{}] * 2, token_ids=[prompt + answer] * 2, action_mask=[[0] * len(prompt) + [1] * 2] * 2,
                      action_turns=[[0, 0]] * 2, prompt_lengths=[len(prompt)] * 2, completions=["Paris"] * 2,
                      truncated=[False] * 2, turns=[1] * 2)
    [sample] = pick_samples(tok, rollout, Feedback([[1.0], [1.0]]), torch.zeros(1, 2), 2, multi_turn=False)
    assert sample["prompt"] == tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False)
    assert sample["prompt"].startswith("<|im_start|>system\n")
    assert sample["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
