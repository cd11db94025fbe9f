"""Our dependency-free TensorBoard event writer, read back by TensorBoard's own reader."""

from __future__ import annotations

import pytest

from worker.tracking.tensorboard_events import crc32c, event_file, event_file_name


def test_crc32c_matches_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C (Castagnoli) check value
    assert crc32c(b"") == 0


def test_tensorboard_reads_every_step_and_scalar(tmp_path):
    pytest.importorskip("tensorboard", reason="the tracking extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = {0: {"eval_reward_mean": 0.25}, 1: {"reward_mean": 0.5, "loss": -1.5e-3, "reward/exact_mean": 1.0},
             300: {"reward_mean": 0.75, "eval_reward_mean": 0.875}}
    path = tmp_path / event_file_name("ftjob-x", 1_700_000_000.5)
    path.write_bytes(event_file(steps, 1_700_000_000.5))
    assert "tfevents" in path.name
    acc = EventAccumulator(str(path))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"eval_reward_mean", "reward_mean", "loss", "reward/exact_mean"}
    read = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            read.setdefault(e.step, {})[tag] = e.value
            assert e.wall_time == 1_700_000_000.5
    assert read.keys() == steps.keys()
    for step, values in steps.items():
        assert read[step] == pytest.approx(values, rel=1e-6)  # stored as float32, as TensorBoard's own writer does
