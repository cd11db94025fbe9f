"""Random streams keyed by what they are for, never by which process draws them.

A job's random choices (each completion's tokens, each episode's reset seed,
which sequences share a mini-batch) are drawn from streams whose seeds mix
the job seed with the place of the draw: the trainer step, the prompt's
index in the whole batch, the completion's index in its group, the turn.
A prompt thus gets the same completions whether its batch runs in one
process or is split over N (each rank holds a contiguous share of the
prompts and knows their global indices), and a resumed run draws what the
uninterrupted one drew without replaying any generator's state.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["stream_seed", "generator"]


def stream_seed(purpose: str, *keys: int) -> int:
    """A 63-bit seed for the stream named by `purpose` and `keys` (e.g. "sample", job seed, step, prompt).

    A hash, so nearby keys (step 3 vs 4, prompt 0 vs 1) give unrelated streams, and purposes never collide.
    """
    text = ":".join([purpose, *map(str, keys)]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def generator(purpose: str, *keys: int) -> torch.Generator:
    """A CPU generator seeded with stream_seed(purpose, *keys)."""
    return torch.Generator().manual_seed(stream_seed(purpose, *keys))
