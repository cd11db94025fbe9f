"""A request's prompts tokenized and checked against the model's length: what fits, or a refusal naming the field."""

from __future__ import annotations

from worker.serving.engine import ResidentModel

# No text averages more characters a token than this (English runs about 4, code about 3 to 6), so a prompt
# longer than max_len * MAX_CHARS_PER_TOKEN characters cannot fit the model: it is refused before tokenizing,
# which for megabytes of text would hold this worker, and every request decoding beside it, for seconds.
MAX_CHARS_PER_TOKEN = 16


class Refused(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def encode(resident: ResidentModel, prompts: list[dict], max_tokens: int, *, asked: bool
           ) -> tuple[list[list[int]], int]:
    """The prompts' ids and the tokens each completion may have: max_tokens when the client asked for it (a
    400 if it does not fit), else the default cut to what the longest prompt leaves of the model's length."""
    out = []
    for prompt in prompts:
        param = "messages" if "messages" in prompt else "prompt"
        chars = len(prompt["text"]) if "text" in prompt else sum(len(m["content"]) for m in prompt["messages"])
        if chars > (most := resident.max_len * MAX_CHARS_PER_TOKEN):
            raise Refused(f"{param}: the prompt is {chars} characters; {resident.base} takes at most "
                          f"{resident.max_len} tokens in all, which no text longer than {most} characters fits",
                          param)
        try:
            out.append(resident.prompt_ids(prompt))
        except ValueError as e:
            raise Refused(f"{param}: {e}", param) from None
    longest = max(map(len, out))
    room = resident.max_len - longest
    if room < 1 or (asked and max_tokens > room):
        param = "messages" if "messages" in prompts[0] else "prompt"
        raise Refused(f"{param}: the prompt is {longest} tokens" + (f" and max_tokens asks for {max_tokens} more"
                      if asked else "") + f"; {resident.base} takes at most {resident.max_len} in all", param)
    return out, min(max_tokens, room)
