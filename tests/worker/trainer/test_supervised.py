"""Supervised fine-tuning (worker/trainer/supervised.py): assistant tokens only, and the loss is the
token-mean cross-entropy computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from worker.trainer import supervised
from worker.model.policy import Policy

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab="},
        {"role": "assistant", "content": "b"}]


@pytest.fixture(scope="module")
def tokenizer(toy_dir):
    return AutoTokenizer.from_pretrained(toy_dir / "model")


def _text(tokenizer, ids):
    return "".join(tokenizer.convert_ids_to_tokens(ids))


def test_only_the_assistant_turn_and_an_added_eos_are_targets(tokenizer):
    example = supervised.encode_conversation(tokenizer, CHAT)
    ids, mask = example.token_ids, example.target_mask
    context = [t for t, m in zip(ids, mask) if not m]
    targets = [t for t, m in zip(ids, mask) if m]
    # The toy template renders "role: content\n" per message and "assistant: " as the generation prompt.
    assert _text(tokenizer, context) == "system: be brief\nuser: ab=\nassistant: "
    assert _text(tokenizer, targets) == "b\n</s>"
    assert mask == [0] * len(context) + [1] * len(targets)  # targets come last, after all the context


def test_a_weight_zero_assistant_turn_is_context(tokenizer):
    chat = [{"role": "user", "content": "a="}, {"role": "assistant", "content": "x", "weight": 0},
            {"role": "user", "content": "b="}, {"role": "assistant", "content": "b"}]
    example = supervised.encode_conversation(tokenizer, chat)
    targets = [t for t, m in zip(example.token_ids, example.target_mask) if m]
    assert _text(tokenizer, targets) == "b\n</s>"
    assert _text(tokenizer, example.token_ids) == "user: a=\nassistant: x\nuser: b=\nassistant: b\n</s>"
    with pytest.raises(ValueError, match="no assistant message"):
        supervised.encode_conversation(tokenizer, chat[:1])


def _tiny_policy(tokenizer) -> Policy:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return Policy(model=model, tokenizer=tokenizer, device=torch.device("cpu"))


def _hand_cross_entropy(model, examples) -> float:
    """-mean over every target token of log softmax(logits)[target], one position at a time in plain Python."""
    total, count = 0.0, 0
    for ex in examples:
        with torch.no_grad():
            logits = model(torch.tensor([ex.token_ids])).logits[0].tolist()
        for t in range(1, len(ex.token_ids)):
            if not ex.target_mask[t]:
                continue
            row = logits[t - 1]  # position t-1 predicts token t
            log_z = math.log(sum(math.exp(v) for v in row))
            total += -(row[ex.token_ids[t]] - log_z)
            count += 1
    return total / count


def test_the_loss_is_the_hand_computed_token_mean_cross_entropy(tokenizer):
    policy = _tiny_policy(tokenizer)
    chats = [CHAT, [{"role": "user", "content": "abcd="}, {"role": "assistant", "content": "dd"}]]
    examples = [supervised.encode_conversation(tokenizer, c) for c in chats]
    expected = _hand_cross_entropy(policy.model, examples)
    # Micro-batches of one and of two give the same token mean (the normaliser is the whole step's targets).
    for micro in (1, 2):
        loss, tokens = supervised.cross_entropy(policy, examples, micro_batch_size=micro, chunk_size=4)
        assert tokens == 3 + 4  # "b\n</s>" and "dd\n</s>"
        assert loss == pytest.approx(expected, rel=1e-5)
    # A training step reports the same loss (measured before its update) and changes the weights.
    before = [p.detach().clone() for p in policy.model.parameters()]
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    stats = supervised.supervised_step(policy, optimizer, examples, micro_batch_size=1, chunk_size=4,
                                       max_grad_norm=None)
    assert stats["loss"] == pytest.approx(expected, rel=1e-5) and stats["target_tokens"] == 7
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.model.parameters()))
    after, _ = supervised.cross_entropy(policy, examples, micro_batch_size=2, chunk_size=4)
    assert after < expected  # one step down the gradient of this very loss


def test_prompt_tokens_get_no_gradient(tokenizer):
    """Changing what follows only context positions' predictions leaves the loss unchanged: a target mask of 0
    means the prompt tokens' own predictions never enter the loss."""
    policy = _tiny_policy(tokenizer)
    ex = supervised.encode_conversation(tokenizer, CHAT)
    first_target = ex.target_mask.index(1)
    logp = torch.zeros(1, len(ex.token_ids))
    logp[0, :first_target] = -100.0  # the prompt's tokens: hugely unlikely, yet no loss
    logp[0, first_target:] = -0.5
    mask = torch.tensor([ex.target_mask], dtype=torch.float32)
    assert float(supervised.supervised_loss(logp, mask, float(mask.sum()))) == pytest.approx(0.5)
