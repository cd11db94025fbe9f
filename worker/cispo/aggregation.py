"""How an optimizer step's per-token losses are averaged: over tokens, sequences or prompts.

The loss of a step is sum_i w_i * sum_t loss_i,t / N over its sequences i:

    token     w_i = 1                      N = action tokens of the step (the CISPO paper)
    sequence  w_i = 1 / n_i                N = sequences of the step
    prompt    w_i = 1 / n_p(i)             N = distinct prompts of the step (ScaleRL's prompt-level average)

with n_i the action tokens of sequence i and n_p the action tokens of all of
prompt p's sequences in this step. Token-level weighs long completions more;
sequence-level weighs every completion alike; prompt-level weighs every
prompt alike whatever its completions' lengths, and within a prompt every
token alike. A prompt's sequences share a process (whole groups per rank), so
n_p is known locally; N is summed over processes by the caller.
"""

from __future__ import annotations


def sequence_weights(level: str, counts: list[int], prompts: list[int]) -> tuple[list[float], float]:
    """(w_i for each sequence, this process's share of N) for sequences with `counts` action tokens from `prompts`."""
    if len(counts) != len(prompts):
        raise ValueError(f"{len(counts)} token counts for {len(prompts)} prompt ids")
    if level == "token":
        return [1.0] * len(counts), float(sum(counts))
    if level == "sequence":
        return [1.0 / max(n, 1) for n in counts], float(len(counts))
    if level == "prompt":
        per_prompt: dict[int, int] = {}
        for n, p in zip(counts, prompts):
            per_prompt[p] = per_prompt.get(p, 0) + n
        return [1.0 / max(per_prompt[p], 1) for p in prompts], float(len(per_prompt))
    raise ValueError(f"unknown loss normalization {level!r}")
