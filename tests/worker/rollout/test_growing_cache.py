"""The decode loop's cache grown in place: the same keys, values, tokens and log-probs as transformers'
DynamicCache, without copying the cache at every step."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tests.worker.rollout.test_decode import CPU, EOS, PAD, spec
from worker.rollout import decode
from worker.rollout.growing_cache import growing_cache


def _gqa_model() -> LlamaForCausalLM:
    """A small random Llama with grouped KV heads (4 query heads on 2 KV heads, as Qwen2.5 groups them)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    return LlamaForCausalLM(config).eval()


def test_keys_and_values_equal_dynamic_caches_in_one_buffer():
    """Step by step, and across a row selection with repeats (prefix sharing) and a drop (finished rows), each
    layer returns DynamicCache's keys and values; between selections every step writes the same buffer."""
    config = _gqa_model().config
    grown, plain = growing_cache(config, capacity=12), DynamicCache(config=config)
    gen = torch.Generator().manual_seed(0)

    def step(rows: int, length: int) -> None:
        k, v = (torch.randn(rows, 2, length, 16, generator=gen) for _ in range(2))
        for layer in range(config.num_hidden_layers):
            got, expected = grown.update(k, v, layer), plain.update(k, v, layer)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])

    step(2, 5)  # two distinct prompts prefilled
    for cache in (grown, plain):
        cache.batch_select_indices(torch.tensor([0, 0, 1, 1]))  # a group of two completions each
    buffer = grown.layers[0].keys.untyped_storage().data_ptr()
    for _ in range(3):
        step(4, 1)
        assert grown.layers[0].keys.untyped_storage().data_ptr() == buffer  # written in place, not concatenated
    for cache in (grown, plain):
        cache.batch_select_indices(torch.tensor([1, 3]))  # two rows finished
    step(2, 1)
    assert grown.get_seq_length() == plain.get_seq_length() == 9
    with pytest.raises(ValueError, match="holds 12 positions"):
        step(2, 4)


@pytest.mark.parametrize("greedy", [True, False])
def test_decoding_gives_the_dynamic_caches_tokens_and_logprobs_bit_for_bit(monkeypatch, greedy):
    """Left-padded prompts of several lengths, a group sharing each prompt, rows ending at different steps:
    the tokens and the recorded log-probs are exactly those decoding with transformers' DynamicCache gives."""
    model = _gqa_model()
    g = torch.Generator().manual_seed(2)
    prompts = [[1] + torch.randint(3, 48, (n,), generator=g).tolist() for n in (3, 7, 5)]
    rows = [p for p in prompts for _ in range(2)]
    kw = dict(max_new=40, sampling=spec(), greedy=greedy, eos_id=EOS, pad_id=PAD, device=CPU, logprobs=True,
              seeds=None if greedy else list(range(len(rows))))
    grown = decode.sample_tokens(model, rows, **kw)
    monkeypatch.setattr(decode, "growing_cache", lambda config, capacity: DynamicCache(config=config))
    plain = decode.sample_tokens(model, rows, **kw)
    assert grown == plain
    if not greedy:
        assert len({len(t) for t in grown[0]}) > 1  # rows finished at different steps, so rows left the cache
