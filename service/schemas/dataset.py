"""What a dataset row must look like: one rule for upload validation and for the trainer.

A row is a JSON object that holds its prompt in one of two ways (every
other field is the reward's or environment's to read):

- ``{"prompt": "text" | [{role, content}, ...], ...}``: ours; a string is
  used as is (completion style), a message list goes through the chat template;
- ``{"messages": [{role, content}, ...], ...}``: OpenAI's reinforcement
  fine-tuning rows; the conversation the model answers, so it must not end
  with an assistant message.

Supervised jobs (``method.type: supervised``) read OpenAI's SFT rows instead:
``{"messages": [...]}`` with at least one assistant message, whose tokens are
the targets (an assistant message with ``"weight": 0`` is context only). An
upload holds either kind (the method is not known yet), so ``row_problem(row,
"upload")`` lets a conversation end with the assistant; creating a job checks
its rows against its method (service/row_shapes.py), as the trainer does.
"""

from __future__ import annotations

PROMPT_FIELDS = ("prompt", "messages")


def _messages_problem(name: str, messages: list) -> str | None:
    if not messages:
        return f"'{name}' is an empty list of messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m.get("role"):
            return f"'{name}'[{i}] needs a non-empty string 'role'"
        if not isinstance(m.get("content"), str):
            return f"'{name}'[{i}] needs a string 'content'"
    return None


RowUse = str  # "cispo" (prompts to sample from), "supervised" (conversations to imitate), "upload" (either)


def _supervised_problem(row: dict) -> str | None:
    if "messages" not in row:
        return "a supervised row needs 'messages' (chat messages ending with the assistant's turn)"
    messages = row["messages"]
    if not isinstance(messages, list):
        return f"'messages' must be a list of chat messages, got {type(messages).__name__}"
    if problem := _messages_problem("messages", messages):
        return problem
    weights = [m.get("weight", 1) for m in messages if m["role"] == "assistant"]
    if not weights:
        return "'messages' has no assistant message: a supervised row needs one to train on"
    if any(w not in (0, 1) for w in weights):
        return "'messages': an assistant message's 'weight' must be 0 or 1"
    if not any(weights):
        return "'messages': every assistant message has weight 0, so the row has nothing to train on"
    return None


def row_problem(row: object, use: RowUse = "cispo") -> str | None:
    """What is wrong with one parsed JSONL row for `use`, or None if the trainer can use it."""
    if use == "supervised":
        return f"a row must be a JSON object, got {type(row).__name__}" if not isinstance(row, dict) \
            else _supervised_problem(row)
    if not isinstance(row, dict):
        return f"a row must be a JSON object, got {type(row).__name__}"
    if "prompt" in row and "messages" in row:
        return "give 'prompt' or 'messages', not both"
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list):
            return f"'messages' must be a list of chat messages, got {type(messages).__name__}"
        if problem := _messages_problem("messages", messages):
            return problem
        if messages[-1]["role"] == "assistant" and use != "upload":
            return "'messages' ends with an assistant message; the model writes that turn, so end with the user's"
        return None
    if "prompt" not in row:
        return "missing 'prompt' (a string or a list of chat messages) or 'messages' (OpenAI's chat rows)"
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return None if prompt else "'prompt' is an empty string"
    if isinstance(prompt, list):
        return _messages_problem("prompt", prompt)
    return f"'prompt' must be a string or a list of chat messages, got {type(prompt).__name__}"


def row_prompt(row: dict) -> str | list[dict]:
    """The prompt of a row that passed row_problem: a string or a list of chat messages."""
    return row["prompt"] if "prompt" in row else row["messages"]
