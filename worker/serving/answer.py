"""One request answered: prompts tokenized and checked against the model's length, then each choice streamed."""

from __future__ import annotations

from collections.abc import Callable

from worker.serving.engine import ResidentModel
from worker.serving.stream import TextDeltas, stream_tokens


# No text averages more characters a token than this (English runs about 4, code about 3 to 6), so a prompt
# longer than max_len * MAX_CHARS_PER_TOKEN characters cannot fit the model: it is refused before tokenizing,
# which for megabytes of text would hold this worker, and every request queued behind it, for seconds.
MAX_CHARS_PER_TOKEN = 16


class Refused(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class Cancelled(Exception):
    """The caller hung up: nothing more of this request is decoded."""


def answer(resident: ResidentModel, request: dict, send: Callable[..., None],
           cancelled: Callable[[], bool] = lambda: False) -> None:
    """Decode the request's choices one token at a time, looking before each token whether its caller is gone;
    raises Cancelled (naming the tokens decoded so far) when it is."""
    sampling, prompts = request["sampling"], request["prompts"]
    try:
        encoded, max_new = _encode(resident, prompts, sampling["max_tokens"], asked=sampling["max_tokens_asked"])
    except Refused as e:
        send(type="error", status=400, message=str(e), param=e.param, code="context_length_exceeded")
        return
    n, tok = sampling["n"], resident.tokenizer
    send(type="start", prompt_tokens=sum(map(len, encoded)), choices=len(encoded) * n)
    decoded = 0
    with resident.weights(request["target"]["checkpoint"]) as model:
        for p, ids in enumerate(encoded):
            for j in range(n):
                index = p * n + j
                seed = None if sampling["seed"] is None else sampling["seed"] + index
                deltas, count, reason = TextDeltas(tok, sampling["stop"]), 0, "length"
                for token in stream_tokens(model, ids, max_new=max_new,
                                           temperature=sampling["temperature"], top_p=sampling["top_p"],
                                           seed=seed, eos_id=tok.eos_token_id, device=resident.device):
                    if cancelled():
                        raise Cancelled(f"after {decoded} tokens")
                    count += 1
                    decoded += 1
                    if token == tok.eos_token_id:
                        reason = "stop"
                        break
                    if text := deltas.add(token):
                        send(type="delta", index=index, text=text)
                    if deltas.stopped:
                        reason = "stop"
                        break
                if not deltas.stopped and (rest := deltas.flush()):
                    send(type="delta", index=index, text=rest)
                send(type="finish", index=index, reason=reason, tokens=count)


def _encode(resident: ResidentModel, prompts: list[dict], max_tokens: int, *, asked: bool
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
