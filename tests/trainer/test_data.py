"""Dataset rows on the trainer side: the upload's row rule, and OpenAI chat rows prompt like ours."""

from __future__ import annotations

import json

import pytest

from service.schemas.dataset import row_prompt
from worker.trainer.data import DataError, read_rows
from worker.rollout.rollout import encode_prompt
from worker.trainer.turns import first_messages

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
