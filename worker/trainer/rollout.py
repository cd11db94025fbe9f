"""Rollouts with transformers generation: group_size completions per prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.schemas.job_spec import SamplingSpec
from worker.trainer.policy import Policy


@dataclass
class Rollout:
    """One rollout batch; sequence i belongs to prompt i // group_size."""

    rows: list[dict]  # per sequence
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # up to and including EOS when it was sampled
    completions: list[str]
    truncated: list[bool]  # stopped by the token budget, not by EOS

    def __len__(self) -> int:
        return len(self.completion_ids)


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def generate(
    policy: Policy,
    rows: list[dict],
    sampling: SamplingSpec,
    *,
    group_size: int,
    greedy: bool = False,
) -> Rollout:
    tok = policy.tokenizer
    prompts = [encode_prompt(tok, row["prompt"]) for row in rows]
    longest = max(len(p) for p in prompts)
    budget = min(sampling.max_output_tokens, sampling.max_model_len - longest)
    if budget < 1:
        raise ValueError(
            f"a prompt of {longest} tokens leaves no room for output within max_model_len={sampling.max_model_len}"
        )
    batch = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(policy.device)
    knobs = dict(do_sample=False) if greedy else dict(
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k or None,
        min_p=sampling.min_p or None,
    )
    model = policy.model
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(
            **batch,
            **knobs,
            repetition_penalty=sampling.repetition_penalty,
            max_new_tokens=budget,
            num_return_sequences=1 if greedy else group_size,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    model.train(was_training)
    copies = 1 if greedy else group_size
    new_tokens = out[:, batch["input_ids"].shape[1] :].tolist()
    completion_ids, truncated = [], []
    for seq in new_tokens:
        if tok.eos_token_id in seq:
            seq = seq[: seq.index(tok.eos_token_id) + 1]
            truncated.append(False)
        else:
            truncated.append(True)
        completion_ids.append(seq)
    return Rollout(
        rows=[row for row in rows for _ in range(copies)],
        prompt_ids=[p for p in prompts for _ in range(copies)],
        completion_ids=completion_ids,
        completions=tok.batch_decode(completion_ids, skip_special_tokens=True),
        truncated=truncated,
    )
