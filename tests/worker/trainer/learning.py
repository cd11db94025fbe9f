"""What the learning tests measure of one run: how far the train reward and the greedy eval moved."""

from __future__ import annotations

from contextlib import contextmanager

import torch


def learning_gains(label: str, rewards: list[float], result, *, window: int = 10) -> tuple[float, float]:
    """(train gain, eval gain): the mean reward of the last `window` steps minus that of the first `window`, and
    the last eval's eval_reward_mean minus the first's (result: what Trainer.run returned). Printed, since one
    run's outcome swings with its random draws and a failing test should show every seed's."""
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    before, after = result.first_eval["eval_reward_mean"], result.last_eval["eval_reward_mean"]
    print(f"{label}: train reward {first:.3f} -> {last:.3f}; eval {before:.3f} -> {after:.3f}")
    return last - first, after - before


@contextmanager
def one_thread():
    """One torch thread while a learning run trains: its float sums, and so a run's course, depend on the thread
    count, which a test before it in the process may have left at anything (vLLM's CPU worker even pins it,
    replacing torch.set_num_threads with a no-op; torch._C's is the real one)."""
    before = torch.get_num_threads()
    torch._C.set_num_threads(1)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)
