"""Build a tiny character-level causal LM and tokenizer, saved with save_pretrained.

    python -m worker.toy.tiny_model OUT_DIR [--heads N]

The model is a 2-layer Llama (about 0.1M parameters) pre-trained for a few
seconds on 'letters=X</s>' where X is the last letter a third of the time and
a random letter otherwise: it knows the answer format and holds a weak prior
for the rule, which reinforcement learning then has to sharpen. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from worker.toy.task import LETTERS

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 =+-*/?:.,!\n")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def _format_batch(tokenizer, rng: random.Random, n: int) -> torch.Tensor:
    texts = []
    for _ in range(n):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 5)))
        # A weak prior for the rule: the right answer a third of the time.
        answer = word[-1] if rng.random() < 1 / 3 else rng.choice(LETTERS)
        texts.append(f"{word}={answer}")
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    ids = enc["input_ids"]
    lengths = enc["attention_mask"].sum(-1)
    ids = torch.cat([ids, torch.full((n, 1), tokenizer.pad_token_id)], dim=1)
    ids[torch.arange(n), lengths] = tokenizer.eos_token_id
    return ids


def build_tiny_model(out_dir: Path, *, seed: int = 0, pretrain_steps: int = 150, attention_heads: int = 4) -> Path:
    """``attention_heads`` 2 gives head_dim 32, the smallest vLLM's CPU attention supports (4 gives 16)."""
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=attention_heads,
        num_key_value_heads=attention_heads,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(pretrain_steps):
        ids = _format_batch(tokenizer, rng, 64)
        labels = ids.masked_fill(ids == tokenizer.pad_token_id, -100)
        loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heads", type=int, default=4, choices=(1, 2, 4, 8),
                        help="attention heads (hidden size 64): 4 gives head size 16, which vLLM on CPU refuses; "
                        "2 gives 32, which vLLM runs on CPU and CUDA")
    args = parser.parse_args()
    print(build_tiny_model(args.out_dir, seed=args.seed, attention_heads=args.heads))


if __name__ == "__main__":
    main()
