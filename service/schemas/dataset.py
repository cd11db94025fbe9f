"""What a dataset row must look like: one rule for upload validation and for the trainer."""

from __future__ import annotations


def row_problem(row: object) -> str | None:
    """What is wrong with one parsed JSONL row, or None if the trainer can use it."""
    if not isinstance(row, dict):
        return f"a row must be a JSON object, got {type(row).__name__}"
    if "prompt" not in row:
        return "missing 'prompt' (a string or a list of chat messages)"
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return None if prompt else "'prompt' is an empty string"
    if isinstance(prompt, list):
        if not prompt:
            return "'prompt' is an empty list of messages"
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m.get("role"):
                return f"'prompt'[{i}] needs a non-empty string 'role'"
            if not isinstance(m.get("content"), str):
                return f"'prompt'[{i}] needs a string 'content'"
        return None
    return f"'prompt' must be a string or a list of chat messages, got {type(prompt).__name__}"
