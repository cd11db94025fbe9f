"""Checks on user Python source at registration: it compiles and names real identifiers.

Nothing here executes the source; that only ever happens in the sandbox.
"""

from __future__ import annotations

import keyword

MAX_SOURCE_BYTES = 256 * 1024


def check_source(source: str, filename: str) -> str:
    """The source if it is small enough and compiles; else ValueError naming the line."""
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > MAX_SOURCE_BYTES:
        raise ValueError(f"source is {size} bytes, more than {MAX_SOURCE_BYTES} (256 KiB)")
    try:
        compile(source, filename, "exec", dont_inherit=True)
    except SyntaxError as e:
        raise ValueError(f"source line {e.lineno}: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
        raise ValueError(f"source does not compile: {e}") from None
    return source


def check_identifier(name: str, field: str) -> str:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"{field} {name!r} is not a Python identifier")
    return name
