"""Parsed JSON that the rest of the system can carry: bounded nesting, and text that is Unicode.

Valid JSON can still break what reads it later:
- a string may hold a lone UTF-16 surrogate (`"\\ud800"`): Python takes it,
  but no UTF-8 encoder does, so a tokenizer, PostgreSQL or a log line fails
  on it far from the request that sent it;
- nesting as deep as Python's parser allows (about a thousand levels) leaves
  no room for whatever walks the value next (a validator, json.dumps, the
  worker's own parse).

`json_problem` walks a parsed value without recursion and names the first
such place by its path (`messages[0].content`, the form error messages use);
`may_hold_problem` tells from the JSON text, far faster, when there is
nothing to find, so most dataset rows are never walked.
"""

from __future__ import annotations

import re

MAX_NESTING = 64  # arrays and objects inside each other; rows and request bodies need a handful
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate(text: str) -> str | None:
    """What is wrong with `text` as Unicode, or None."""
    if (found := _SURROGATE.search(text)) is None:
        return None
    return (f"holds a lone UTF-16 surrogate (\\u{ord(found.group()):04x} at character {found.start()}), "
            "which is not Unicode text; send the character itself or its surrogate pair")


def _path(parts: tuple) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def json_problem(value: object, *, max_nesting: int = MAX_NESTING) -> tuple[str, str] | None:
    """(path, what is wrong) at the first string that is not Unicode text or the first container nested
    deeper than `max_nesting`; None when the value is fine. Keys are checked like strings."""
    stack: list[tuple[object, int, tuple]] = [(value, 0, ())]
    while stack:
        node, depth, where = stack.pop()
        if isinstance(node, str):
            if problem := lone_surrogate(node):
                return _path(where), problem
        elif isinstance(node, (dict, list)):
            if depth >= max_nesting:
                return _path(where), f"nests arrays and objects deeper than {max_nesting} levels"
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in reversed(list(items)):
                if isinstance(key, str) and (problem := lone_surrogate(key)):
                    return _path(where), f"has a key that {problem}"
                stack.append((child, depth + 1, (*where, key)))
    return None


def may_hold_problem(raw: bytes, *, max_nesting: int = MAX_NESTING) -> bool:
    """False when the JSON text `raw` cannot hold what json_problem finds: a level of nesting takes a bracket,
    and a lone surrogate arrives only as a \\u escape (UTF-8 cannot encode one)."""
    return raw.count(b"[") + raw.count(b"{") > max_nesting or _SURROGATE_ESCAPE.search(raw) is not None
