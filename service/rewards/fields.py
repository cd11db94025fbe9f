"""Which row fields a reward spec reads, so a dry run can find the rows that lack them.

Builtin checks name a ``field`` (read as ``row[field]``); grader templates
name ``{{ item.<path> }}``. What user code reads (a python reward, a remote
http scorer that gets the whole row) cannot be known without running it, and
is reported as not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from service.schemas.templates import variables

# Types that read row[field] (similarity only when no reference template replaces it).
FIELD_TYPES = {"exact_match", "contains", "numeric_match", "similarity"}
OPAQUE = {"python": "a python reward reads the row in its own code",
          "http": "an http reward's server reads the row itself"}


@dataclass(frozen=True)
class FieldUse:
    param: str  # where the spec names it, e.g. "rewards.exact.field"
    path: tuple[str, ...]  # keys into the row (a digit indexes a list)

    @property
    def shown(self) -> str:
        return ".".join(self.path)


def _templates(value, param: str):
    """(param, template) for every string in a spec value."""
    if isinstance(value, str):
        yield param, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _templates(item, f"{param}.{key}" if param else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _templates(item, f"{param}[{i}]")


def fields_read(spec: Mapping, param: str = "") -> tuple[list[FieldUse], list[tuple[str, str]]]:
    """(the row fields the reward reads, (param, why) for what cannot be known), for a dumped reward spec."""
    kind = spec.get("type")
    where = f"{param}." if param else ""
    if kind == "multi":
        uses, opaque = [], []
        for name, sub in spec.get("rewards", {}).items():
            u, o = fields_read(sub, f"{where}rewards.{name}")
            uses += u
            opaque += o
        return uses, opaque
    if kind in OPAQUE:
        return [], [(param, OPAQUE[kind])]
    uses = []
    if kind in FIELD_TYPES and not spec.get("reference"):
        uses.append(FieldUse(f"{where}field", (spec.get("field", "answer"),)))
    for at, text in _templates({k: v for k, v in spec.items() if k != "type"}, param):
        for var in variables(text):
            head, _, rest = var.partition(".")
            if head == "item" and rest:
                uses.append(FieldUse(at, tuple(rest.split("."))))
    return uses, []


def has_path(row: object, path: tuple[str, ...]) -> bool:
    for key in path:
        if isinstance(row, Mapping) and key in row:
            row = row[key]
        elif isinstance(row, list) and key.isdigit() and int(key) < len(row):
            row = row[int(key)]
        else:
            return False
    return True
