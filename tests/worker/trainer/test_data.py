"""Dataset rows on the trainer side: the upload's row rule, and OpenAI chat rows prompt like ours."""

from __future__ import annotations

import json

import pytest

from service.schemas.dataset import row_prompt
from worker.trainer.data import DataError, read_rows
from worker.rollout.rollout import encode_prompt
from worker.model.turns import first_messages

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc="}]


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_message_rows_are_read_and_bad_ones_name_file_and_line(tmp_path):
    good = _write(tmp_path, [json.dumps({"messages": CHAT, "answer": "c"}), "", json.dumps({"prompt": "x"})])
    assert [r.get("answer") for r in read_rows(good)] == ["c", None]
    bad = _write(tmp_path, [json.dumps({"messages": CHAT}), json.dumps({"messages": CHAT[:1] + [
        {"role": "assistant", "content": "done"}]})])
    with pytest.raises(DataError, match=r"rows.jsonl:2: 'messages' ends with an assistant message"):
        read_rows(bad)


def test_a_messages_row_prompts_exactly_like_the_same_prompt_list(toy_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_dir / "model")

    ours, openai = {"prompt": CHAT}, {"messages": CHAT}
    assert encode_prompt(tok, row_prompt(openai)) == encode_prompt(tok, row_prompt(ours))
    assert first_messages(None, openai) == first_messages(None, ours) == CHAT  # environment jobs too


def test_retired_rows_are_skipped_and_survive_a_resume():
    """Without retirement the sampler draws its plain permutation; retired rows are left out of later draws, the
    state carries them (and only then), and the last row left is never retired."""
    import torch

    from service.schemas.recipe import PassRateFilterSpec
    from worker.trainer.data import PromptSampler
    from worker.trainer.prompt_filter import retire_solved

    rows = [{"prompt": str(i)} for i in range(6)]
    plain = PromptSampler(rows, seed=3)
    first = plain.next_batch(3)
    assert plain.state() == {"epoch": 0, "index": 3}
    assert first == [rows[i] for i in plain.last_indices]

    sampler = PromptSampler(rows, seed=3)
    assert sampler.next_batch(3) == first
    # Group pass rates 1.0, 0.5 and 0.0 at threshold 0.9: only the first prompt is retired.
    rewards = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    assert retire_solved(sampler, list(sampler.last_indices), rewards, PassRateFilterSpec()) == 1
    solved = sampler.last_indices[0]
    assert sampler.state()["retired"] == [solved]
    resumed = PromptSampler(rows, seed=3, **sampler.state())
    drawn = [resumed.next_batch(2) for _ in range(6)]
    assert all(rows[solved] not in batch for batch in drawn)
    assert drawn == [sampler.next_batch(2) for _ in range(6)]

    sampler.retire(list(range(6)))
    assert len(sampler.retired) == 5 and len(sampler.next_batch(4)) == 4  # the one row left fills the batch
