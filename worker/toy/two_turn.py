"""A two-turn toy environment: the reward depends only on the second answer.

Turn 1: the environment asks for a letter ('letter?'); any answer will do
(reward 0). Turn 2: it shows the row's word ('abc='); the reward is 1 if the
answer is that word's last letter, else 0.

Used by the multi-turn learning test and as an example of the ``python``
environment protocol. Standard library only, on purpose: the trainer sends
this module's source to the environment sandbox (``environment_spec()``), as
a user would.

The tiny model (worker/toy/tiny_model.py) was pre-trained on 'word=X</s>'
only. ``plain_chat_model()`` copies it with a chat template that renders just
the message contents after BOS, so a two-turn chat reads
'<s>letter?X</s>abc=Y</s>', close to the text it knows, and reinforcement
learning starts from its weak prior, as on the single-turn task. (Under the
toy's 'role: content' template it answers with noise, and learning the format
from a reward of almost always 0 takes far longer than a test may.)
"""

from __future__ import annotations

from pathlib import Path

FIRST_QUESTION = "letter?"
PLAIN_CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


class TwoTurnLetters:
    def reset(self, seed, row):
        self.word = row["prompt"].rstrip("=")
        self.turn = 0
        return FIRST_QUESTION

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return f"{self.word}=", 0.0, False, False, {}
        return None, float(action.strip() == self.word[-1]), True, False, {"word": self.word}


def environment_spec(**limits) -> dict:
    """This module as a ``python`` environment spec (source and class name)."""
    return {"type": "python", "source": Path(__file__).read_text(), "class_name": "TwoTurnLetters", **limits}


def plain_chat_model(model_dir: Path, out_dir: Path) -> Path:
    """A copy of the tiny model whose chat template renders only BOS and the message contents."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return out_dir
