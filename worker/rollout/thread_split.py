"""How the trainer and its sampler process share the CPU threads of asynchronous rollouts.

Synchronously, one process runs every phase with all of torch's threads. With
a sampler process beside it, both would start that many threads on the same
cores and preempt each other mid-matmul (on 2 cores: 4 busy threads, each
phase slower than alone). Split instead: the sampler gets half the threads and
the trainer the rest, so each phase runs on cores of its own (on this 2-core
machine: one each) and the phases overlap instead of interleaving.
"""

from __future__ import annotations


def split_threads(total: int) -> tuple[int, int]:
    """(trainer threads, sampler threads) out of `total`: half each, the odd one to the trainer, at least 1 each."""
    sampler = max(1, total // 2)
    return max(1, total - sampler), sampler
