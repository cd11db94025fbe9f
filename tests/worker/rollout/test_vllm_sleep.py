"""The vLLM engine's sleep and wake on a GPU, with the engine itself replaced by a recorder (no GPU here): the
sleep level follows the training mode, and the trainer's cached memory goes back to the GPU before waking."""

from __future__ import annotations

import torch

from worker.rollout.vllm_engine import VLLMEngine, sleep_level


class RecordingLLM:
    def __init__(self, calls: list):
        self.calls = calls

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self) -> None:
        self.calls.append(("wake_up",))


def _engine(monkeypatch, *, lora: bool) -> tuple[VLLMEngine, list]:
    calls: list = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    engine = VLLMEngine.__new__(VLLMEngine)  # what __init__ sets on a GPU with rollout.sleep_mode
    engine.llm, engine.sleep_enabled, engine._asleep = RecordingLLM(calls), True, False
    engine.sleep_level = sleep_level(lora=lora)
    return engine, calls


def test_full_fine_tuning_sleeps_at_level_2_and_frees_the_cache_before_waking(monkeypatch):
    engine, calls = _engine(monkeypatch, lora=False)
    engine._sleep()
    engine._sleep()  # already asleep: nothing
    engine._wake()
    engine._wake()
    assert calls == [("sleep", 2), ("empty_cache",), ("wake_up",)]


def test_lora_keeps_the_base_weights_asleep_at_level_1(monkeypatch):
    engine, calls = _engine(monkeypatch, lora=True)
    engine._sleep()
    engine._wake()
    assert calls == [("sleep", 1), ("empty_cache",), ("wake_up",)]

