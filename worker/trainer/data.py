"""Prompt datasets: JSONL rows, a held-out split, and a resumable sampler."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from service.schemas.dataset import row_problem
from service.job_spec.spec import DataSpec


class DataError(ValueError):
    """A dataset row or file is unusable; the message names the file and line."""


def read_rows(path: str | Path, use: str = "cispo") -> list[dict]:
    """The rows of a JSONL file, each checked for `use` ("cispo" prompts or "supervised" conversations)."""
    rows = []
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_no}: invalid JSON ({e.msg})") from None
            problem = row_problem(row, use)
            if problem:
                raise DataError(f"{path}:{line_no}: {problem}")
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def load_splits(spec: DataSpec, *, seed: int, use: str = "cispo") -> tuple[list[dict], list[dict]]:
    """(train rows, validation rows); the held-out fraction is drawn with the job's seed."""
    train = read_rows(spec.train_file, use)
    if spec.validation_file:
        return train, read_rows(spec.validation_file, use)
    n_val = int(len(train) * spec.validation_fraction)
    if n_val == 0:
        return train, []
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:n_val])
    return [r for i, r in enumerate(train) if i not in held], [train[i] for i in order[:n_val]]


class PromptSampler:
    """Yields batches of rows in a fresh seeded permutation each epoch, skipping retired rows.

    Its whole state is (epoch, index, retired rows), so a resumed run draws
    exactly the batches the uninterrupted run would have drawn. Rows are
    retired by training.pass_rate_filter (worker/trainer/prompt_filter.py);
    without it none are, and the draws are those of a plain permutation.
    """

    def __init__(self, rows: list[dict], *, seed: int, epoch: int = 0, index: int = 0,
                 retired: list[int] | tuple[int, ...] = ()):
        self.rows, self.seed, self.epoch, self.index = rows, seed, epoch, index
        self.retired: set[int] = set(retired)
        self.last_indices: list[int] = []  # the row indices of the last batch, in order
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def next_batch(self, size: int) -> list[dict]:
        self.last_indices = []
        while len(self.last_indices) < size:
            if self.index == len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            row = self._order[self.index]
            self.index += 1
            if row not in self.retired:
                self.last_indices.append(row)
        return [self.rows[i] for i in self.last_indices]

    def retire(self, indices: list[int]) -> None:
        """Stop drawing these rows; the last row that is left is never retired (a batch must come from somewhere)."""
        for i in indices:
            if i not in self.retired and len(self.retired) + 1 < len(self.rows):
                self.retired.add(i)

    def state(self) -> dict:
        state = {"epoch": self.epoch, "index": self.index}
        if self.retired:  # only then, so a job without the filter saves exactly what it always did
            state["retired"] = sorted(self.retired)
        return state
