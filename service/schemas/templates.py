"""OpenAI grader templates: ``{{ item.<path> }}`` and ``{{ sample.output_text }}``, checked and rendered.

Pure and torch-free, because both sides need it: the API checks every
template when a reward or grader is registered (so a typo fails the request,
not step 1 of a job), and the worker renders them per sample.

Variables (everything else is refused by name):

- ``item`` / ``item.<path>``: the dataset row, or a value in it; a path is
  dot-separated keys, and a number indexes a list (``item.choices.0``);
- ``sample.output_text``: the completion;
- ``sample.output_json`` / ``sample.output_json.<path>``: the completion
  parsed as JSON (a completion that is not JSON is a sample error).

A string value renders as itself; any other value (numbers, lists, objects,
null) as compact JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

_VARIABLE = re.compile(r"\{\{\s*(.*?)\s*\}\}", re.DOTALL)
_PATH = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)*$")
SUPPORTED = "item, item.<path>, sample.output_text, sample.output_json, sample.output_json.<path>"


class TemplateError(ValueError):
    """A variable names something the row (or the completion) does not have: the sample's error."""


class SampleParseError(ValueError):
    """``sample.output_json`` was used but the completion is not JSON."""


def variables(template: str) -> list[str]:
    return _VARIABLE.findall(template)


def check_template(template: str) -> str:
    """Raise ValueError naming the first unsupported variable, or an unclosed ``{{``; returns the template."""
    rest = _VARIABLE.sub("", template)
    if (at := rest.find("{{")) >= 0:
        raise ValueError(f"template has a '{{{{' with no closing '}}}}': {rest[at:at + 40]!r} (a variable is written "
                         f"{{{{ item.<path> }}}}; supported: {SUPPORTED})")
    for var in variables(template):
        if not _PATH.match(var):
            raise ValueError(f"template variable {{{{ {var} }}}} is not a dotted name (supported: {SUPPORTED})")
        head, _, rest = var.partition(".")
        if head == "item":
            continue
        if head == "sample" and (rest == "output_text" or rest == "output_json" or rest.startswith("output_json.")):
            continue
        raise ValueError(f"template variable {{{{ {var} }}}} is not supported (supported: {SUPPORTED})")
    return template


def is_plain_variable(template: str) -> str | None:
    """The variable when the whole template is exactly one ``{{ ... }}``, else None."""
    match = _VARIABLE.fullmatch(template.strip())
    return match.group(1) if match else None


def _walk(value: Any, path: list[str], shown: str) -> Any:
    for i, key in enumerate(path):
        where = ".".join([shown, *path[:i]])
        if isinstance(value, Mapping):
            if key not in value:
                fields = ", ".join(map(repr, sorted(value))) or "none"
                raise TemplateError(f"template: {where} has no field {key!r} (fields: {fields:.200})")
            value = value[key]
        elif isinstance(value, list) and key.isdigit():
            if int(key) >= len(value):
                raise TemplateError(f"template: {where} has {len(value)} elements, no index {key}")
            value = value[int(key)]
        else:
            raise TemplateError(f"template: {where} is a {type(value).__name__}, it has no field {key!r}")
    return value


def lookup(var: str, completion: str, row: Mapping[str, Any]) -> Any:
    """The value a checked variable names for one sample."""
    head, *path = var.split(".")
    if head == "item":
        return _walk(row, path, "item")
    if path[0] == "output_text":
        return completion
    try:
        parsed = json.loads(completion)
    except ValueError:
        raise SampleParseError("sample_parse: the completion is not JSON, so sample.output_json is undefined") from None
    return _walk(parsed, path[1:], "sample.output_json")


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def render(template: str, completion: str, row: Mapping[str, Any]) -> str:
    """The template with each variable replaced by its value for this sample."""
    if "{{" not in template:
        return template
    return _VARIABLE.sub(lambda m: as_text(lookup(m.group(1), completion, row)), template)
