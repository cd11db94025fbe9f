"""Supervised fine-tuning (`method: supervised`): token-mean cross-entropy on the assistant turns of chat rows.

OpenAI's SFT rows, `{"messages": [..., {"role": "assistant", ...}]}`. A row becomes one sequence: the
context (system, user, tool turns and each assistant turn's generation prompt) has target mask 0, the
assistant's text (and the closing text its template renders, e.g. ChatML's <|im_end|>) mask 1, and EOS is
appended after the last assistant turn when the template closes it without one, so the model learns to stop.
An assistant message with `"weight": 0` is context too.

The sequence is built segment by segment, like a multi-turn rollout (worker/model/turns.py): the first
context exactly as a rollout encodes the prompt (so a CISPO job that continues this model sees the same
tokens), then each later piece of rendered template text tokenized on its own.

The loss of an optimizer step is -sum(log p(target) * mask) / (assistant tokens in the step), so a
micro-batch adds its share and the gradient equals one pass over the whole batch. It reuses the trainer's
scoring path (worker/trainer/scoring.py), so LoRA, full fine-tuning, bf16 and checkpoints are the same as
CISPO's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from worker.trainer.scoring import collate_sequences, sequence_logprobs
from worker.trainer.step import optimizer_step
from worker.model.turns import chat_ids


@dataclass
class Example:
    token_ids: list[int]
    target_mask: list[int]  # 1 where the token is the assistant's (a target of the loss)


def _render(tokenizer, messages: list[dict], *, generation_prompt: bool) -> str:
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    return tokenizer.apply_chat_template(plain, add_generation_prompt=generation_prompt, tokenize=False)


def encode_conversation(tokenizer, messages: list[dict]) -> Example:
    """The conversation up to its last trained assistant message, with that message's tokens as targets."""
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("weight", 1)]
    if not trained:
        raise ValueError("the conversation has no assistant message to train on")
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = chat_ids(tokenizer, messages[:first])
    mask = [0] * len(ids)
    rendered = _render(tokenizer, messages[:first], generation_prompt=True)
    for i in range(first, trained[-1] + 1):
        if messages[i]["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True)
        after = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if not before.startswith(rendered) or not after.startswith(before):
            raise ValueError("the chat template does not render conversations turn by turn (adding a turn changes "
                             "the text before it), so assistant tokens cannot be told from the context")
        context = tokenizer(before[len(rendered):], add_special_tokens=False)["input_ids"]
        answer = tokenizer(after[len(before):], add_special_tokens=False)["input_ids"]
        weight = int(bool(messages[i].get("weight", 1)))
        if i == trained[-1] and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in answer:
            answer = answer + [tokenizer.eos_token_id]
        ids += context + answer
        mask += [0] * len(context) + [weight] * len(answer)
        rendered = after
    return Example(ids, mask)


def supervised_loss(logp_BT: Tensor, target_mask_BT: Tensor, normalizer: float) -> Tensor:
    """-sum of the targets' log-probs / normalizer (the step's assistant-token count): a token-mean CE."""
    return -(logp_BT * target_mask_BT).sum() / normalizer


def _micro_batches(examples: list[Example], size: int) -> list[list[Example]]:
    ordered = sorted(examples, key=lambda e: len(e.token_ids))  # similar lengths pad little
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def _logprobs(policy, batch_examples: list[Example], chunk_size: int):
    batch = collate_sequences([e.token_ids for e in batch_examples], [e.target_mask for e in batch_examples],
                              pad_id=policy.tokenizer.pad_token_id, device=policy.device)
    with policy.autocast():
        logp, _ = sequence_logprobs(policy.model, batch, temperature=1.0, chunk_size=chunk_size)
    return logp, batch.action_mask_BT


def cross_entropy(policy, examples: list[Example], *, micro_batch_size: int, chunk_size: int) -> tuple[float, int]:
    """(token-mean cross-entropy on the targets, target tokens), without gradients: the eval loss."""
    total = sum(sum(e.target_mask) for e in examples)
    model = policy.model
    was_training = model.training
    model.eval()
    loss = 0.0
    with torch.no_grad():
        for micro in _micro_batches(examples, micro_batch_size):
            logp, mask = _logprobs(policy, micro, chunk_size)
            loss += float(supervised_loss(logp, mask, max(total, 1)))
    model.train(was_training)
    return loss, total


def supervised_step(policy, optimizer, examples: list[Example], *, micro_batch_size: int, chunk_size: int,
                    max_grad_norm: float | None) -> dict[str, float]:
    """One optimizer step on the examples; its loss (token mean over the whole batch) and gradient norm."""
    total = sum(sum(e.target_mask) for e in examples)
    model = policy.model
    model.train()
    optimizer.zero_grad(set_to_none=True)
    step_loss = 0.0
    for micro in _micro_batches(examples, micro_batch_size):
        logp, mask = _logprobs(policy, micro, chunk_size)
        loss = supervised_loss(logp, mask, max(total, 1))
        loss.backward()
        step_loss += float(loss.detach())
    # the optimizer's parameters: the job's own (on a shared base the model holds other jobs' adapters too)
    norm = optimizer_step([p for group in optimizer.param_groups for p in group["params"]], optimizer, max_grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return {"loss": step_loss, "grad_norm": norm, "target_tokens": float(total),
            "sequence_tokens": float(sum(len(e.token_ids) for e in examples))}
