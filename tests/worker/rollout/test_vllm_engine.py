"""The vLLM rollout engine against transformers on the tiny model: same greedy text, live LoRA, matching log-probs.

All tests share one engine (tests/worker/rollout/vllm_fixtures.py). Each pushes the
weights it needs before sampling, so their order does not matter.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from service.job_spec.sampling import SamplingSpec
from tests.worker.rollout.test_multi_turn import Scripted, word_then_done
from tests.specs import vllm_job_spec
from worker.rollout import HFEngine
from worker.toy.task import make_rows
from worker.model.policy import load_policy
from worker.trainer.scoring import collate_sequences, sequence_logprobs

ROWS = make_rows(12, seed=7)
GREEDY = SamplingSpec(temperature=1.0, max_output_tokens=4, max_model_len=32)


@pytest.fixture
def policy(vllm_toy_dir):
    torch.manual_seed(0)
    return load_policy(vllm_job_spec(vllm_toy_dir), resume_from=None, warm_start=None)


def set_adapter(policy, seed: int, scale: float = 0.5) -> None:
    """Random LoRA B matrices (A is random already): the adapter now changes the model's outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def trainer_logprobs(policy, rollout, temperature: float) -> list[torch.Tensor]:
    """The trainer's log-prob of each action token, per sequence (eval mode, no grad)."""
    batch = collate_sequences(rollout.token_ids, rollout.action_mask, pad_id=policy.tokenizer.pad_token_id,
                              device=policy.device)
    policy.model.eval()
    with torch.no_grad():
        logp, _ = sequence_logprobs(policy.model, batch, temperature=temperature, chunk_size=1024)
    mask = batch.action_mask_BT.bool()
    return list(logp[mask].split(mask.sum(-1).tolist()))


def test_greedy_completions_equal_transformers(policy, vllm_engine):
    """With the fresh (zero-effect) adapter, vLLM's greedy ids and texts are exactly transformers'."""
    hf = HFEngine().generate(policy, ROWS, GREEDY, group_size=1, greedy=True)
    vllm = vllm_engine.generate(policy, ROWS, GREEDY, group_size=1, greedy=True)
    assert vllm.token_ids == hf.token_ids
    assert vllm.completions == hf.completions
    assert vllm.action_mask == hf.action_mask
    assert hf.sampler_logprobs is None
    assert [len(lp) for lp in vllm.sampler_logprobs] == vllm.action_counts


def test_lora_hot_load_follows_the_adapter(policy, vllm_engine):
    """Each sync serves the adapter as it is now: vLLM's greedy output tracks transformers' as the weights change."""
    base = HFEngine().generate(policy, ROWS, GREEDY, group_size=1, greedy=True).token_ids
    for seed in (1, 2):
        set_adapter(policy, seed)
        hf = HFEngine().generate(policy, ROWS, GREEDY, group_size=1, greedy=True).token_ids
        assert hf != base, "the adapter should change some greedy completion"
        assert vllm_engine.generate(policy, ROWS, GREEDY, group_size=1, greedy=True).token_ids == hf
        # a fresh directory and id each sync; the previous adapter is dropped from the engine and from disk
        assert vllm_engine.llm.llm_engine.list_loras() <= {vllm_engine._lora.lora_int_id}
        assert [p.name for p in vllm_engine._adapters.iterdir()] == [f"adapter-{vllm_engine._lora.lora_int_id}"]
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    assert vllm_engine.generate(policy, ROWS, GREEDY, group_size=1, greedy=True).token_ids == base


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_agree_with_the_trainer(policy, vllm_engine, temperature):
    """Sampled with an adapter at temperature T, each token's vLLM log-prob matches the trainer's within 1e-4."""
    set_adapter(policy, 3, scale=0.2)
    sampling = SamplingSpec(temperature=temperature, max_output_tokens=4, max_model_len=32)
    torch.manual_seed(0)
    rollout = vllm_engine.generate(policy, ROWS[:6], sampling, group_size=4)
    assert len(rollout) == 24
    assert len({tuple(ids) for ids in rollout.token_ids}) > 6, "sampling, not greedy"
    for sampler, trainer in zip(rollout.sampler_logprobs, trainer_logprobs(policy, rollout, temperature)):
        torch.testing.assert_close(torch.tensor(sampler), trainer, rtol=0, atol=1e-4)


def test_sampling_follows_the_job_rng(policy, vllm_engine):
    """Request seeds come from torch's RNG: the same seed gives the same samples (resume), another seed others."""
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(vllm_engine.generate(policy, ROWS[:4], GREEDY, group_size=4).token_ids)
    assert runs[0] == runs[1] != runs[2]


def test_full_weight_sync_serves_the_new_weights(vllm_toy_dir, vllm_engine):
    """Full fine-tuning's sync (a state dict loaded in place) makes vLLM greedy-decode like the new model."""
    model_dir = vllm_toy_dir / "model"
    original = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    changed = copy.deepcopy(original)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    prompts = [[1] + [5 + (i * 7 + k) % 6 for k in range(2 + i % 3)] + [44] for i in range(8)]  # '<s>' word '='

    def hf_greedy(model):
        return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=4, pad_token_id=0,
                               eos_token_id=2)[0, len(p):].tolist() for p in prompts]

    def vllm_greedy():
        return vllm_engine.sample(prompts, [4] * len(prompts), greedy=True)[0]

    try:
        vllm_engine.sync(changed)
        assert vllm_engine._lora is None  # a full model is served without an adapter
        expected = hf_greedy(changed)
        assert expected != hf_greedy(original)
        assert vllm_greedy() == expected
    finally:
        vllm_engine.sync(original)
    assert vllm_greedy() == hf_greedy(original)


def test_multi_turn_rollout_through_vllm(policy, vllm_engine, vllm_toy_dir):
    """Environment episodes: two action runs per sequence, environment turns masked, log-probs aligned to actions."""
    set_adapter(policy, 4, scale=0.2)
    sampling = vllm_job_spec(vllm_toy_dir).sampling
    rows = [{"prompt": "abc="}, {"prompt": "fed="}]
    env = Scripted(word_then_done)
    torch.manual_seed(0)
    rollout = vllm_engine.generate(policy, rows, sampling, group_size=2, environment=env, max_turns=2, seeds=[1, 2])
    tok = policy.tokenizer
    assert rollout.turns == [2] * 4 and rollout.turn_rewards == [[0.5, 1.0]] * 4
    assert sorted(env.released) == sorted(env.actions)
    for i, (ids, mask) in enumerate(zip(rollout.token_ids, rollout.action_mask)):
        actions = [j for j, m in enumerate(mask) if m]
        first_end = next(j for j in range(actions[0], len(mask)) if not mask[j])
        second_start = next(j for j in range(first_end, len(mask)) if mask[j])
        assert tok.decode(ids[first_end:second_start]) == f"\nuser: {rows[i // 2]['prompt']}\nassistant: "
        assert len(rollout.sampler_logprobs[i]) == len(actions) == rollout.action_counts[i]
    for sampler, trainer in zip(rollout.sampler_logprobs, trainer_logprobs(policy, rollout, sampling.temperature)):
        torch.testing.assert_close(torch.tensor(sampler), trainer, rtol=0, atol=1e-4)
