"""How the updater cuts a mini-batch into micro-batches."""

from __future__ import annotations

from worker.trainer.update import micro_batches


def test_micro_batches_put_similar_lengths_together():
    """Every sequence lands in exactly one micro-batch, and a short one never pads up to a long one's length."""
    lengths = {0: 10, 1: 100, 2: 12, 3: 98, 4: 50}
    chunks = micro_batches([3, 0, 4, 1, 2], lengths, 2)
    assert sorted(i for c in chunks for i in c) == [0, 1, 2, 3, 4]
    assert chunks == [[0, 2], [4, 3], [1]]
    padded = sum(max(lengths[i] for i in c) * len(c) for c in chunks)
    assert padded == 12 * 2 + 98 * 2 + 100  # in the given order it would be 98*2 + 100*2 + 12
