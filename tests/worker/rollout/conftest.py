"""Fixtures of the rollout tests: the tiny LoRA model the trainer tests use too, and the session's vLLM engine."""

from tests.worker.rollout.vllm_fixtures import vllm_engine, vllm_toy_dir  # noqa: F401  (session-scoped, shared)
from tests.worker.trainer.conftest import lora_model  # noqa: F401
