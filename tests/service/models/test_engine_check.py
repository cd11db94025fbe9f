"""The vLLM compatibility rules the dry run and the worker share (vllm 0.32.0's, see the module)."""

from __future__ import annotations

from service.models.engine_check import (
    cpu_accepts, cuda_accepts, head_size, head_size_refusal, lora_rank_problem,
)
from worker.rollout import refuse_unsupported_model


def test_head_size_from_a_config():
    assert head_size({"hidden_size": 64, "num_attention_heads": 4}) == 16  # the toy model
    assert head_size({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}) == 32  # explicit wins
    assert head_size({"model_type": "x"}) is None


def test_which_devices_take_which_head_sizes():
    assert [h for h in (8, 16, 20, 32, 40, 64, 128, 256, 512) if cpu_accepts(h)] == [32, 64, 128, 256, 512]
    assert [h for h in (8, 16, 20, 32, 40, 64, 128, 256, 512) if cuda_accepts(h)] == [8, 16, 32, 40, 64, 128, 256]
    assert head_size_refusal(16, cuda=False).startswith("vLLM on CPU cannot run attention head size 16 (")
    assert head_size_refusal(16, cuda=True) is None and head_size_refusal(32, cuda=False) is None
    assert "multiples of 8 up to 256" in head_size_refusal(20, cuda=True)


def test_lora_ranks_up_to_512():
    assert lora_rank_problem(512) is None
    assert lora_rank_problem(513) == "lora.r is 513, but vLLM serves LoRA ranks up to 512"


def test_the_worker_refuses_before_starting_vllm():
    import pytest

    from service.models.engine_check import EngineUnsupported

    with pytest.raises(EngineUnsupported, match="rollout.engine is 'vllm', but vLLM on CPU cannot run attention "
                                                "head size 16"):
        refuse_unsupported_model({"hidden_size": 64, "num_attention_heads": 4}, cuda=False)
    refuse_unsupported_model({"hidden_size": 64, "num_attention_heads": 2}, cuda=False)
    refuse_unsupported_model({"hidden_size": 64, "num_attention_heads": 4}, cuda=True)
