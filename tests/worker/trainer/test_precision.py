"""bf16 compute on float32 master weights, in one process: small updates accumulate, checkpoints resume exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from service.job_spec.spec import JobSpec
from worker.toy.__main__ import toy_spec

LR = 1e-5  # many of the toy model's SGD steps are then below half a bf16 step of their weight (counted below)


def bf16_spec(toy_dir: Path, *, lora: bool = False, lr: float = 3e-3, **training) -> JobSpec:
    raw = toy_spec(toy_dir)
    raw["dtype"] = "bfloat16"
    raw["optimizer"] = {"lr": lr}
    raw["lora"] = raw["lora"] if lora else None
    raw["training"].update({"steps": 2, "batch_size": 2, "group_size": 4, "mini_batches": 1, "micro_batch_size": 4,
                            "eval_interval": 0, "eval_max_rows": 2, "checkpoint_interval": 1, **training})
    return JobSpec.model_validate(raw)


def test_lora_keeps_float32_adapters_on_a_bf16_base(toy_dir):
    from worker.model.policy import load_policy

    policy = load_policy(bf16_spec(toy_dir, lora=True), resume_from=None, warm_start=None)
    trainable = {p.dtype for p in policy.model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in policy.model.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {torch.bfloat16}


def test_updates_below_bf16_resolution_accumulate_in_the_master_weights(toy_dir):
    """Three SGD steps of lr * grad, each below half a bf16 step of its weight, add up exactly in float32."""
    from tests.worker.distributed.test_distributed import fixed_batch
    from worker.model.policy import load_policy
    from worker.trainer.update import Updater

    spec = bf16_spec(toy_dir)
    torch.manual_seed(0)
    policy = load_policy(spec, resume_from=None, warm_start=None)
    params = dict(policy.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}
    assert policy.reference_model is None or next(policy.reference_model.parameters()).dtype == torch.bfloat16
    start = {n: p.detach().clone() for n, p in params.items()}
    summed = {n: torch.zeros_like(p) for n, p in params.items()}

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            for n, p in params.items():
                summed[n] += p.grad
            return super().step(closure)

    optimizer = Recording(policy.trainable_parameters(), lr=LR)
    rollout, advantages = fixed_batch()
    for _ in range(3):
        Updater(policy, optimizer, spec).run(rollout, advantages, list(range(len(rollout))))

    invisible = total = 0
    for n, p in params.items():
        w0 = start[n]
        # The float32 master weight moved by exactly what SGD added, up to float32 rounding.
        torch.testing.assert_close(p.detach(), w0 - LR * summed[n], rtol=2e-7, atol=0, msg=n)
        # Where a step is below half the bf16 spacing of its weight (2^-8 relative), a bf16 weight would not
        # move at all: each step would round back to where it started.
        bf16 = w0.to(torch.bfloat16)
        stays = (bf16.float() - LR * summed[n] / 3).to(torch.bfloat16) == bf16
        invisible += int((stays & (p.detach() != w0)).sum())
        total += int((summed[n] != 0).sum())  # embedding rows of tokens the batch lacks get no gradient
    assert invisible > 0.25 * total  # measured: 45% of the weights with a gradient moved only in float32


def test_bf16_checkpoint_is_bf16_for_users_and_resumes_from_float32(toy_dir, tmp_path):
    """model/ holds bf16 weights that from_pretrained loads; the float32 masters resume bit for bit."""
    from tests.worker.trainer.test_trainer import StopAt
    from worker.trainer.loop import Trainer, train

    spec = bf16_spec(toy_dir, lr=1e-5)
    straight = train(spec, tmp_path / "straight")
    assert train(spec, tmp_path / "split", callbacks=StopAt(1)).stopped
    resumed = Trainer(spec, tmp_path / "split")
    assert resumed.step == 1
    split = resumed.run()

    ckpt = straight.last_checkpoint
    files = load_file(str(ckpt / "model" / "model.safetensors"))
    assert {v.dtype for v in files.values()} == {torch.bfloat16}
    assert json.loads((ckpt / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    assert loaded.dtype == torch.bfloat16
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in files.items())

    a, b = (load_file(str(c / "trainer_state.safetensors")) for c in (ckpt, split.last_checkpoint))
    masters = {k for k in a if k.startswith("user.master.")}
    assert masters and {a[k].dtype for k in masters} == {torch.float32}
    assert a.keys() == b.keys()
    for k in a:  # master weights, optimizer moments, RNG state
        assert torch.equal(a[k], b[k]), k
    for k in masters:  # what users get is the masters rounded to bf16
        assert torch.equal(a[k].to(torch.bfloat16), files[k.removeprefix("user.master.")])


@pytest.mark.parametrize("saved,bf16,expected", [
    ("float16", True, torch.bfloat16), ("bfloat16", True, torch.bfloat16), ("float32", True, torch.float32),
    ("float16", False, torch.float32), ("bfloat16", False, torch.float32)])
def test_auto_dtype_on_a_gpu_is_bf16_for_half_checkpoints_never_fp16(toy_dir, tmp_path, monkeypatch, saved, bf16,
                                                                      expected):
    """'auto' on a GPU: bfloat16 where the device has it (a float16 checkpoint included: float16 training underflows
    without loss scaling), float32 where it has not."""
    from worker.model import precision

    config = json.loads((toy_dir / "model" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": saved}))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert precision.compute_dtype("auto", str(tmp_path), torch.device("cuda")) == expected


@pytest.mark.parametrize("saved,avx512_bf16,amx,expected", [
    ("bfloat16", True, False, torch.bfloat16), ("float16", False, True, torch.bfloat16),
    ("float32", True, True, torch.float32), ("bfloat16", False, False, torch.float32)])
def test_auto_dtype_on_a_cpu_is_bf16_for_half_checkpoints_where_its_matmuls_have_bf16(
        toy_dir, tmp_path, monkeypatch, saved, avx512_bf16, amx, expected):
    """'auto' on a CPU: bfloat16 for a half-precision checkpoint where the CPU multiplies bf16 natively (the toy task
    learns as in float32 there: bench/README.md), float32 where torch would emulate it or the checkpoint is float32."""
    from worker.model import precision

    config = json.loads((toy_dir / "model" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": saved}))
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert precision.compute_dtype("auto", str(tmp_path), torch.device("cpu")) == expected


@pytest.mark.parametrize("native", [False, True])
def test_a_bf16_job_is_warned_where_the_cpu_emulates_bf16(toy_dir, tmp_path, monkeypatch, native):
    """dtype bfloat16 (or rollout.dtype) on a CPU without AVX512-BF16 or AMX runs emulated, tens of times slower
    than float32 (bench/README.md): the job says so once, at its start, and names what to set; not where the CPU
    has bf16 matmuls, nor for a float32 job."""
    from worker.model import precision
    from worker.trainer.loop import Trainer

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    warnings = []

    class Warned:
        def on_warning(self, step, message):
            warnings.append((step, message))

        def __getattr__(self, name):
            return lambda *a, **k: False if name == "should_stop" else None

    Trainer(bf16_spec(toy_dir, lora=True, steps=1, checkpoint_interval=0), tmp_path / "run").run(Warned())
    if native:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0][0] == 0
        assert "emulated" in warnings[0][1] and "'auto'" in warnings[0][1]
    cpu = torch.device("cpu")
    assert precision.emulated_bf16_warning({torch.float32}, cpu) is None
    assert (precision.emulated_bf16_warning({torch.float32, torch.bfloat16}, cpu) is None) == native


def test_tf32_matmuls_on_cuda_only():
    from worker.model import precision

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        precision.enable_fast_matmul(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == "highest"
        precision.enable_fast_matmul(torch.device("cuda"))
        assert torch.get_float32_matmul_precision() == "high"  # TF32 on Ampere and later
    finally:
        torch.set_float32_matmul_precision(before)
