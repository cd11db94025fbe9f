"""Fixtures shared by the worker tests."""

from tests.worker.vllm_fixtures import vllm_engine, vllm_toy_dir  # noqa: F401  (session-scoped, shared)
