"""The job spec's full fine-tuning, resources and gradient checkpointing fields, and one-process full fine-tuning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from service.job_spec.build import build_spec
from service.job_spec.request import JobCreate
from service.job_spec.spec import JobSpec
from tests.specs import job_spec
from worker.checkpoints.checkpoint import CheckpointError, load_checkpoint
from worker.toy.__main__ import toy_spec


def _error(**overrides) -> dict:
    with pytest.raises(ValidationError) as info:
        job_spec(**overrides)
    [error] = info.value.errors()
    return error


def test_lora_null_means_full_fine_tuning_and_defaults_stay_lora():
    assert job_spec(lora=None).lora is None
    spec = job_spec()
    assert spec.lora is not None and spec.resources.gpus == 1 and not spec.training.gradient_checkpointing


@pytest.mark.parametrize("gpus", [0, 65])
def test_gpus_out_of_bounds_names_the_field(gpus):
    assert _error(resources={"gpus": gpus})["loc"] == ("resources", "gpus")


def test_gpus_must_divide_the_batch():
    error = _error(resources={"gpus": 3}, training={"batch_size": 8})
    assert "resources.gpus (3) must divide training.batch_size (8)" in error["msg"]


def test_mini_batches_must_fit_each_process_share():
    # 4 prompts x 2 completions = 8 sequences, 2 per process at 4 processes: 3 mini-batches cannot be formed.
    error = _error(resources={"gpus": 4}, training={"batch_size": 4, "group_size": 2, "mini_batches": 3})
    assert "training.mini_batches (3) exceeds the sequences per process" in error["msg"]
    job_spec(resources={"gpus": 4}, training={"batch_size": 4, "group_size": 2, "mini_batches": 2})


def test_gpu_count_check_leaves_cpu_runs_alone():
    """One CUDA device per rank is needed; without CUDA (None) any number of gloo ranks share the CPU."""
    from worker.torchrun.launch import TooFewGPUs, refuse_too_few_gpus

    refuse_too_few_gpus(4, None)
    refuse_too_few_gpus(2, 2)
    refuse_too_few_gpus(2, 8)
    with pytest.raises(TooFewGPUs, match="resources.gpus is 4, but this worker sees 2 CUDA devices"):
        refuse_too_few_gpus(4, 2)
    with pytest.raises(ValueError, match="sees 0 CUDA devices"):  # a ValueError: the job fails as invalid_job
        refuse_too_few_gpus(2, 0)


def test_vllm_runs_in_one_process_only():
    error = _error(rollout={"engine": "vllm"}, resources={"gpus": 2}, training={"batch_size": 4})
    assert "rollout.engine 'vllm' runs in one training process, but resources.gpus is 2" in error["msg"]
    job_spec(rollout={"engine": "vllm"}, resources={"gpus": 1})


def test_unknown_resources_field_refused():
    assert _error(resources={"gpus": 2, "cpus": 4})["loc"] == ("resources", "cpus")


def _job_body(hyperparameters: dict) -> JobCreate:
    return JobCreate.model_validate({"model": "org/tiny", "training_file": "file-1",
                                     "method": {"type": "cispo", "cispo": {
                                         "reward": {"type": "exact_match", "field": "answer"},
                                         "hyperparameters": hyperparameters}}})


def test_api_null_lora_asks_for_full_fine_tuning_and_left_out_keeps_the_adapter():
    reward = {"type": "import", "path": "m:f"}
    full = build_spec(_job_body({"lora": None, "resources": {"gpus": 2}}), seed=0, training_rows=10, reward=reward)
    assert full.lora is None and full.resources.gpus == 2
    default = build_spec(_job_body({}), seed=0, training_rows=10, reward=reward)
    assert default.lora is not None


def full_spec(toy_dir: Path, **training) -> JobSpec:
    return job_spec(toy_spec(toy_dir), lora=None, loss={"kl_beta": 0.1}, optimizer={"lr": 1e-3},
                    training={"steps": 1, "batch_size": 8, "group_size": 8, "mini_batches": 1, "micro_batch_size": 16,
                              "eval_max_rows": 4, "gradient_checkpointing": True, **training})


@pytest.mark.slow
def test_full_fine_tuning_trains_every_weight_with_checkpointing(toy_dir, tmp_path):
    """lora: null trains the whole model (gradient checkpointing on, a KL term to a frozen copy); the
    checkpoint holds the whole model, the reference is unchanged, and an adapter job refuses it."""
    from worker.trainer.loop import Trainer, train
    from worker.model.policy import load_policy

    trainer = Trainer(full_spec(toy_dir), tmp_path / "run")
    policy = trainer.policy
    assert not policy.is_lora and policy.model.is_gradient_checkpointing
    assert len(policy.trainable_parameters()) == len(list(policy.model.parameters()))
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    metrics = trainer.train_step()
    assert metrics["kl_ref"] >= 0 and metrics["optimizer_steps"] == 1 and metrics["zero_advantage_group_fraction"] < 1
    after = policy.model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)  # every weight moved, embeddings and norms included
    assert all(torch.equal(before[k], v) for k, v in policy.reference_model.state_dict().items())

    ckpt = load_checkpoint(trainer.save())
    assert ckpt.adapter_dir is None and ckpt.reference_dir is None  # the base model is the reference
    saved = load_file(str(ckpt.model_dir / "model.safetensors"))
    assert all(torch.equal(saved[k], after[k]) for k in saved)
    assert (ckpt.model_dir / "tokenizer_config.json").is_file()

    lora_job = JobSpec.model_validate({**full_spec(toy_dir).model_dump(), "lora": toy_spec(toy_dir)["lora"]})
    with pytest.raises(CheckpointError, match="holds a whole model, but the job"):
        load_policy(lora_job, resume_from=None, warm_start=ckpt)

    # A warm start from it pins the loaded model as the reference and saves it with every checkpoint.
    warm = full_spec(toy_dir, gradient_checkpointing=False).model_copy(update={"init_from": str(ckpt.path)})
    result = train(warm, tmp_path / "warm")
    pinned = load_checkpoint(result.last_checkpoint)
    assert pinned.reference_dir is not None
    reference = load_file(str(pinned.reference_dir / "model.safetensors"))
    assert all(torch.equal(reference[k], saved[k]) for k in saved)
