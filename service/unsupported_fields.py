"""Fields a client may well send that a request refuses: real fields (OpenAI's, or ours in another section)
that this method or route does not support, each with what to use instead.

An unknown field the table does not name is most likely a typo; one it names is a choice the client made
on purpose, so the message says it is not supported here and points to what works.
"""

from __future__ import annotations

_NO_LOGPROBS = "served completions carry no log-probabilities here; leave it out"
_NO_TOOLS = "this service serves no tool calls; describe the tools in the messages instead"
_CISPO_ONLY = "only a cispo job takes it, under method.cispo.hyperparameters"

_INSTEAD: dict[str, str] = {
    # OpenAI's chat.completions / completions fields that serving does not implement
    "logprobs": _NO_LOGPROBS,
    "top_logprobs": _NO_LOGPROBS,
    "tools": _NO_TOOLS,
    "tool_choice": _NO_TOOLS,
    "parallel_tool_calls": _NO_TOOLS,
    "functions": _NO_TOOLS,
    "function_call": _NO_TOOLS,
    "response_format": "no structured outputs here; a json_schema reward trains a model to the format",
    "logit_bias": "no logit biasing here; leave it out",
    "best_of": "use n for several completions of one prompt",
    "suffix": "completions here continue the prompt only; leave it out",
    "audio": "text only here",
    "modalities": "text only here",
    "prediction": "no predicted outputs here; leave it out",
    "reasoning_effort": "models here sample as given; leave it out",
    "service_tier": "there is one tier here; leave it out",
    "store": "completions are not stored here; leave it out",
    "web_search_options": "no web search here; leave it out",
    # The worker's JobSpec fields that the API's request does not take where they were sent
    "init_from": "to start from earlier weights, name the fine-tuned model (ft:...) or one of its checkpoints "
                 "(ftckpt_...) as `model`",
    "optimizer": _CISPO_ONLY + " (a supervised or reinforcement job sets its learning rate with "
                 "learning_rate_multiplier)",
    "loss": _CISPO_ONLY,
    "advantages": _CISPO_ONLY,
    "rollout": _CISPO_ONLY,
    "schedule": _CISPO_ONLY,
    "resources": _CISPO_ONLY,
    # OpenAI's fine-tuning fields that are not implemented
    "expires_after": "files here do not expire; delete one with DELETE /v1/files/{id}",
}


def instead(field: str) -> str | None:
    """What to use instead of a real field sent where it is not supported; None for a name we do not know."""
    return _INSTEAD.get(field)


def unknown_field_message(field: object) -> str:
    hint = instead(field) if isinstance(field, str) else None
    if hint is not None:
        return f"not supported here: {hint}"
    return "unknown field (not part of this request; check the spelling)"
