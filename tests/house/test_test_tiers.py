"""The tiers of tests/conftest.py name real files: a test moved to another folder must not slip out of `heavy`
into `make check`, the fast tier, where one stack of processes would cost the inner loop minutes."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HEAVY_PATHS

TESTS = Path(__file__).resolve().parents[1]


def test_every_heavy_path_exists():
    missing = [where for where in HEAVY_PATHS if not (TESTS / where).exists()]
    assert not missing, f"HEAVY_PATHS names tests that are not there (moved?): {missing}"
