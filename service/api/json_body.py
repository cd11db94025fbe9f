"""JSON request bodies that are valid JSON but that Python's parser refuses: a 400 that says why.

json.loads raises RecursionError for nesting past the interpreter's stack
(about a thousand levels) and a plain ValueError for an integer longer than
Python converts (sys.get_int_max_str_digits(), 4300 digits). FastAPI turns
either into a bare "There was an error parsing the body"; a route that
parses its own body would turn them into a 500.
"""

from __future__ import annotations

import json

from service.errors import InvalidRequest


def unreadable(cause: BaseException | None) -> str | None:
    """The message for a body the parser refused for `cause`, or None when the cause is not one of those."""
    if isinstance(cause, RecursionError):
        return "the request body is not valid JSON for this service: it nests arrays and objects deeper than " \
               "the parser allows"
    if isinstance(cause, json.JSONDecodeError):
        return f"the request body is not valid JSON ({cause.msg} at position {cause.pos})"
    if isinstance(cause, ValueError):
        return f"the request body is not valid JSON for this service ({str(cause).split(';')[0]})"
    return None


def load(raw: bytes) -> object:
    """The parsed body; InvalidRequest (400, invalid_json) when it cannot be read."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError too
        raise InvalidRequest(unreadable(e), code="invalid_json") from None
