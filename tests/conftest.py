"""Shared fixtures: the tiny model and the toy dataset, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory) -> Path:
    """A directory with the tiny model (model/), train.jsonl, val.jsonl and spec.yaml."""
    pytest.importorskip("torch")
    from worker.toy.__main__ import prepare

    root = tmp_path_factory.mktemp("toy")
    prepare(root)
    return root
