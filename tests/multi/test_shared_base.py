"""The shared base's adapters: which parameters train as jobs join and leave (worker/multi/lora.py)."""

from __future__ import annotations

from worker.multi.lora import SharedBase

from tests.multi.conftest import LORAS, toy_base


def _trainable(shared: SharedBase) -> set[str]:
    return {n for n, p in shared.model.named_parameters() if p.requires_grad}


def test_every_resident_jobs_adapter_trains_and_the_base_does_not(toy_dir):
    shared = SharedBase(toy_base(toy_dir))
    for joined, (name, spec) in enumerate(LORAS.items(), start=1):
        params = shared.add(name, spec)
        assert params and all(p.requires_grad for p in params)
        # PEFT marks only its active adapter trainable on every add: the jobs already resident must train on
        want = {n for n, _ in shared.model.named_parameters()
                if ".lora_" in n and any(f".{job}." in n for job in list(LORAS)[:joined])}
        assert _trainable(shared) == want
    shared.remove("job-b")
    assert all(".lora_" in n and ".job-b." not in n for n in _trainable(shared))
    assert all(p.requires_grad for job in ("job-a", "job-c", "job-d") for p in shared.parameters(job))
