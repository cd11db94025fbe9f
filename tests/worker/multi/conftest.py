"""Fixtures of the shared-base tests: the toy base with several jobs' adapters, and each job's model alone."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.job_spec.spec import LoraSpec
from worker.multi.lora import SharedBase
from worker.model.policy import lora_config

# Jobs that differ in rank, scale and target modules.
LORAS = {
    "job-a": LoraSpec(r=4, alpha=8, target_modules="all-linear"),
    "job-b": LoraSpec(r=8, alpha=4, target_modules=["q_proj", "v_proj"]),
    "job-c": LoraSpec(r=2, alpha=16, target_modules=["o_proj", "down_proj", "up_proj"]),
    "job-d": LoraSpec(r=4, alpha=8, target_modules="all-linear"),
}


def toy_base(toy_dir, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=dtype)


def toy_tokenizer(toy_dir):
    tok = AutoTokenizer.from_pretrained(toy_dir / "model")
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def shared_with_adapters(toy_dir, loras: dict[str, LoraSpec]) -> SharedBase:
    """The toy base with one adapter per job, B far from zero so that every adapter changes what it computes."""
    shared = SharedBase(toy_base(toy_dir))
    for k, (name, spec) in enumerate(loras.items()):
        torch.manual_seed(100 + k)
        shared.add(name, spec)
        with torch.no_grad():
            for n, p in shared.model.named_parameters():
                if f"lora_B.{name}." in n:
                    p.normal_(0, 0.5)
    return shared


def alone(toy_dir, shared: SharedBase, name: str):
    """A model of its own holding job `name`'s adapter (PEFT's plain model, as a job alone runs it)."""
    model = get_peft_model(toy_base(toy_dir), lora_config(shared.specs[name]))
    result = set_peft_model_state_dict(model, {k: v.clone() for k, v in shared.adapter_state(name).items()})
    assert not [k for k in result.unexpected_keys if "lora_" in k]
    assert not [k for k in result.missing_keys if "lora_" in k]
    return model


@pytest.fixture(scope="module")
def tokenizer(toy_dir):
    return toy_tokenizer(toy_dir)


def record_sampled(monkeypatch) -> tuple[dict[object, list], dict[object, list]]:
    """From now on, each Trainer's (a resident job's or one alone) rollouts' token ids, step by step, and the
    sampler's log-probs of those tokens where it reports them; keyed by the trainer object, which the dicts keep
    alive (an id of a trainer already collected can come back as a later one's)."""
    from worker.trainer.loop import Trainer

    tokens: dict[object, list] = {}
    logprobs: dict[object, list] = {}
    real = Trainer.take_rollout

    def recording(self, rollout, *args, **kwargs):
        tokens.setdefault(self, []).append(rollout.token_ids)
        if rollout.sampler_logprobs is not None:
            logprobs.setdefault(self, []).extend(lp for row in rollout.sampler_logprobs for lp in row)
        return real(self, rollout, *args, **kwargs)

    monkeypatch.setattr(Trainer, "take_rollout", recording)
    return tokens, logprobs
