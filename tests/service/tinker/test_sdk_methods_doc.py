"""docs/TINKER.md names every public method of the SDK's four clients in its table of endpoints, so a new SDK
release's methods show up as a failing test rather than as a gap in the table."""

from __future__ import annotations

import re

import pytest

from tests.project_docs import ROOT

tinker = pytest.importorskip("tinker")

CLIENTS = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")


def _tables() -> dict[str, set[str]]:
    """Per `### Client` heading of the doc, the names in backquotes of its table's first column."""
    text = (ROOT / "docs" / "TINKER.md").read_text()
    found = {}
    for client, body in re.findall(r"^### (\w+)\n(.*?)(?=^#|\Z)", text, flags=re.M | re.S):
        rows = [line.split("|")[1] for line in body.splitlines() if line.startswith("| `")]
        found[client] = {name.split("(")[0] for row in rows for name in re.findall(r"`([^`]+)`", row)}
    return found


@pytest.mark.parametrize("client", CLIENTS)
def test_the_doc_names_every_public_method_of_each_client(client):
    cls = getattr(tinker, client)
    public = {name for name in dir(cls) if not name.startswith("_")}
    assert public, client
    assert public - _tables().get(client, set()) == set(), f"docs/TINKER.md's {client} table lacks these"
