"""The shared base's adapters: which parameters train as jobs join and leave (worker/multi/lora.py)."""

from __future__ import annotations

from worker.multi.lora import SharedBase

from tests.worker.multi.conftest import LORAS, toy_base


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


def test_adapters_keep_training_when_the_first_leaves_and_frozen_ones_never_train(toy_dir):
    """Deleting PEFT's active adapter (the first added) makes PEFT mark only its new active one trainable."""
    shared = SharedBase(toy_base(toy_dir))
    names = list(LORAS)
    shared.add(names[0], LORAS[names[0]])
    shared.add("frozen", LORAS[names[1]], trainable=False)
    for name in names[1:]:
        shared.add(name, LORAS[name])
    shared.remove(names[0])
    assert all(p.requires_grad for job in names[1:] for p in shared.parameters(job))
    assert not any(p.requires_grad for p in shared.parameters("frozen"))
    shared.remove(names[1])
    assert all(p.requires_grad for job in names[2:] for p in shared.parameters(job))
    assert shared.parameters("frozen") and not any(p.requires_grad for p in shared.parameters("frozen"))


def _flags(model) -> dict[str, bool]:
    return {n: m.training for n, m in model.named_modules()}


def test_set_training_sets_what_train_sets_without_torchs_recursive_walk(toy_dir, monkeypatch):
    """Three mode switches a cycle, each torch's recursive train() over every module (hundreds at K = 4): the
    shared base sets the same flags in one flat pass, also over the modules of jobs that joined after a switch."""
    import torch

    shared = SharedBase(toy_base(toy_dir))
    names = list(LORAS)
    shared.add(names[0], LORAS[names[0]])
    walks = []
    walk = torch.nn.Module.train
    monkeypatch.setattr(torch.nn.Module, "train", lambda self, mode=True: walks.append(mode) or walk(self, mode))
    shared.set_training(False)
    assert not any(_flags(shared.model).values())
    for name in names[1:]:
        shared.add(name, LORAS[name])  # PEFT's new layers start in training mode
    shared.set_training(False)
    assert not any(_flags(shared.model).values())
    shared.remove(names[1])
    shared.set_training(True)
    assert all(_flags(shared.model).values())
    assert walks == []


def test_set_training_falls_back_to_train_where_a_module_does_more(toy_dir):
    """A module whose class overrides train() (it may do more than set flags) gets its own train() called."""
    import torch

    calls = []

    class Counting(torch.nn.Module):
        def train(self, mode=True):
            calls.append(mode)
            return super().train(mode)

    base = toy_base(toy_dir)
    base.model.extra = Counting()
    shared = SharedBase(base)
    shared.add("job-a", LORAS["job-a"])
    shared.set_training(False)
    assert calls == [False] and not any(_flags(shared.model).values())


def test_a_float32_head_jobs_rows_get_float32_logits_on_a_bfloat16_base(toy_dir):
    """training.lm_head_float32 on a shared base held in bfloat16: that job's rows run the LM head's matmul in float32
    (as its sampler alone does, worker/rollout/effective_weights.py), in any forward, under autocast too; the other
    jobs' rows keep the base's bfloat16 head (their logits cast up exactly)."""
    import torch

    from worker.trainer.scoring import decoder_outputs

    shared = SharedBase(toy_base(toy_dir, torch.bfloat16))
    shared.add("plain", LORAS["job-a"])
    shared.add("float32", LORAS["job-b"], head_float32=True)
    head = shared.model.get_output_embeddings()
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11, 12]])
    for autocast in (False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                shared.router.rows(["plain", "float32", "float32"]), decoder_outputs(shared.model) as hidden:
            logits = shared.model(input_ids=ids).logits
        h = hidden[-1]
        assert logits.dtype == torch.float32
        assert torch.equal(logits[1:], torch.nn.functional.linear(h[1:].float(), head.weight.float()))
        assert torch.equal(logits[:1], torch.nn.functional.linear(h[:1].bfloat16(), head.weight).float())
        assert not torch.equal(logits[1:], torch.nn.functional.linear(h[1:].bfloat16(), head.weight).float())
    shared.remove("float32")
    with torch.no_grad(), shared.router.rows(["plain"]):
        assert shared.model(input_ids=ids[:1]).logits.dtype == torch.bfloat16  # no such job left: the plain head
