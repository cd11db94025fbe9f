"""Checkpoints: exact resume, sha256 verification, atomic writes, no pickle."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from service.job_spec.spec import LoraSpec
from worker.checkpoints.checkpoint import (
    CheckpointError,
    capture_rng,
    check_lora_config,
    checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    load_optimizer_state,
    restore_rng,
    save_checkpoint,
)

LLAMA = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=2)


def make_base(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**LLAMA))


def lora_config(**kw) -> LoraConfig:
    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **kw})


def make_optimizer(model) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def train_step(model, optimizer, seed: int) -> None:
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def lora_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.fixture
def trained():
    model = get_peft_model(make_base(), lora_config())
    optimizer = make_optimizer(model)
    for seed in (1, 2):
        train_step(model, optimizer, seed)
    return model, optimizer


def save(path, model, optimizer, step=2, **kw):
    return save_checkpoint(path, model=model, optimizer=optimizer, state={"step": step}, **kw)


def test_roundtrip_resumes_training_exactly(tmp_path, trained):
    model, optimizer = trained
    state = {"step": 2, "data": {"epoch": 0, "position": 17}, "losses": [1.5, float("inf")]}
    user = {"noise": torch.randn(3, 4)[:, 1], "count": torch.tensor(7)}  # a view on purpose
    path = save_checkpoint(tmp_path / checkpoint_name(2), model=model, optimizer=optimizer,
                           state=state, tensors=user)
    assert path.name == "step-00000002"

    ckpt = load_checkpoint(path)
    assert ckpt.state == state
    assert set(user) <= set(ckpt.tensors)
    for key, value in user.items():
        assert torch.equal(ckpt.tensors[key], value)

    resumed = PeftModel.from_pretrained(make_base(), ckpt.adapter_dir, is_trainable=True)
    before = lora_weights(model)
    assert before.keys() == lora_weights(resumed).keys()
    for name, value in lora_weights(resumed).items():
        assert torch.equal(value, before[name]), name

    fresh = make_optimizer(resumed)
    load_optimizer_state(fresh, ckpt)
    want, got = optimizer.state_dict(), fresh.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert isinstance(got["param_groups"][0]["betas"], tuple)
    assert want["state"].keys() == got["state"].keys() and len(got["state"]) == 4
    for idx, pstate in want["state"].items():
        assert pstate.keys() == got["state"][idx].keys()
        for name, value in pstate.items():
            assert torch.equal(got["state"][idx][name], value), (idx, name)
    assert got["state"][0]["step"].item() == 2

    # One more step on each side must give bit-identical adapters.
    loaded = {k: v.clone() for k, v in ckpt.tensors.items()}
    train_step(model, optimizer, 3)
    train_step(resumed, fresh, 3)
    after = lora_weights(model)
    for name, value in lora_weights(resumed).items():
        assert torch.equal(value, after[name]), name
    # Training the resumed optimizer must not write through into the checkpoint's tensors.
    assert all(torch.equal(ckpt.tensors[k], v) for k, v in loaded.items())


def test_manifest_lists_every_file_with_its_sha256(tmp_path, trained):
    path = save(tmp_path / "step-00000002", *trained)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["step"] == 2
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json",
            "trainer_state.json", "trainer_state.safetensors"} <= on_disk
    for rel, meta in manifest["files"].items():
        data = (path / rel).read_bytes()
        assert meta == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


@pytest.mark.parametrize("rel", ["adapter/adapter_model.safetensors", "trainer_state.safetensors"])
def test_a_flipped_byte_is_refused_naming_the_file(tmp_path, trained, rel):
    path = save(tmp_path / "step-00000002", *trained)
    target = path / rel
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"checkpoint step-00000002: {rel} sha256 mismatch \(expected"):
        load_checkpoint(path)


def test_a_missing_file_is_refused(tmp_path, trained):
    path = save(tmp_path / "step-00000002", *trained)
    (path / "adapter" / "adapter_config.json").unlink()
    with pytest.raises(CheckpointError, match="adapter/adapter_config.json is missing"):
        load_checkpoint(path)


def test_an_unlisted_extra_file_is_ignored(tmp_path, trained):
    path = save(tmp_path / "step-00000002", *trained)
    (path / "notes.txt").write_text("added later")
    assert load_checkpoint(path).state == {"step": 2}


def test_directory_without_manifest_is_refused_and_skipped(tmp_path, trained):
    save(tmp_path / "step-00000002", *trained)
    broken = save(tmp_path / "step-00000005", *trained, step=5)
    (broken / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        load_checkpoint(broken)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"


def test_latest_checkpoint_picks_the_highest_complete_step(tmp_path, trained):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "absent") is None
    for step in (3, 12, 9):
        save(tmp_path / checkpoint_name(step), *trained, step=step)
    (tmp_path / "step-00000099").mkdir()  # no manifest: a crashed save
    (tmp_path / "other-00000100").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000012"


def test_overwriting_a_checkpoint_replaces_it_and_leaves_no_temporaries(tmp_path, trained):
    model, optimizer = trained
    path = save(tmp_path / "step-00000002", model, optimizer)
    (path / "stale.txt").write_text("from the first save")
    train_step(model, optimizer, 3)
    save_checkpoint(path, model=model, optimizer=optimizer, state={"step": 2, "second": True})
    assert load_checkpoint(path).state == {"step": 2, "second": True}
    assert not (path / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002"]
    resumed = PeftModel.from_pretrained(make_base(), path / "adapter")
    after = lora_weights(model)
    for name, value in lora_weights(resumed).items():
        assert torch.equal(value, after[name]), name


def test_a_failed_save_keeps_the_old_checkpoint_and_leaves_nothing_behind(tmp_path, trained):
    path = save(tmp_path / "step-00000002", *trained)
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        save_checkpoint(path, model=trained[0], optimizer=trained[1], state={"step": 2, "bad": object()})
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002"]
    assert load_checkpoint(path).state == {"step": 2}


def test_optimizer_for_other_parameters_is_refused(tmp_path, trained):
    ckpt = load_checkpoint(save(tmp_path / "step-00000002", *trained))
    other = get_peft_model(make_base(), lora_config(r=8))
    with pytest.raises(CheckpointError, match=r"has shape \(4, 16\), the parameter \(8, 16\)"):
        load_optimizer_state(make_optimizer(other), ckpt)
    fewer = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad][:2])
    with pytest.raises(CheckpointError, match="param group 0 has 4 parameters, the optimizer 2"):
        load_optimizer_state(fewer, ckpt)


def test_check_lora_config_names_each_mismatched_field(tmp_path, trained):
    adapter = load_checkpoint(save(tmp_path / "step-00000002", *trained)).adapter_dir
    check_lora_config(adapter, LoraSpec(r=4, alpha=8, target_modules=["v_proj", "q_proj"]))
    with pytest.raises(CheckpointError, match="r: checkpoint 4 vs job 8") as err:
        check_lora_config(adapter, LoraSpec(r=8, alpha=8, target_modules=["q_proj", "v_proj"]))
    assert "target_modules" not in str(err.value) and "lora_alpha" not in str(err.value)
    with pytest.raises(CheckpointError) as err:
        check_lora_config(adapter, LoraSpec(r=4, alpha=16, dropout=0.1))
    msg = str(err.value)
    assert "lora_alpha: checkpoint 8 vs job 16.0" in msg and "lora_dropout: checkpoint 0.0 vs job 0.1" in msg
    assert "target_modules: checkpoint ['q_proj', 'v_proj'] vs job ['k_proj', 'o_proj', 'q_proj', 'v_proj']" in msg
    with pytest.raises(CheckpointError, match="target_modules: checkpoint .* vs job all-linear"):
        check_lora_config(adapter, LoraSpec(r=4, alpha=8, target_modules="all-linear"))


def test_check_lora_config_understands_all_linear(tmp_path):
    model = get_peft_model(make_base(), lora_config(target_modules="all-linear"))
    ckpt = load_checkpoint(save(tmp_path / "step-00000001", model, None, step=1))
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_optimizer_state(make_optimizer(model), ckpt)
    adapter = ckpt.adapter_dir
    check_lora_config(adapter, LoraSpec(r=4, alpha=8, target_modules="all-linear"))
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    check_lora_config(adapter, LoraSpec(r=4, alpha=8, target_modules=every))
    with pytest.raises(CheckpointError, match="target_modules"):
        check_lora_config(adapter, LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))


def test_an_all_linear_adapter_of_twenty_linears_or_more_matches_an_all_linear_job(tmp_path):
    """PEFT writes such an adapter's targets as the shortest suffixes that select them (Llama's seven *_proj
    names): given the job's model, the check sees they select exactly the modules the job's adapter wraps."""
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def three_layers(targets):
        torch.manual_seed(0)
        return get_peft_model(LlamaForCausalLM(LlamaConfig(**{**LLAMA, "num_hidden_layers": 3})),
                              lora_config(target_modules=targets))

    saved = three_layers("all-linear")
    adapter = load_checkpoint(save(tmp_path / "step-00000001", saved, None, step=1)).adapter_dir
    assert sorted(json.loads((adapter / "adapter_config.json").read_text())["target_modules"]) == sorted(every)
    job = three_layers("all-linear")
    check_lora_config(adapter, LoraSpec(r=4, alpha=8, target_modules="all-linear"), job)
    check_lora_config(adapter, LoraSpec(r=4, alpha=8, target_modules=every), three_layers(every))
    with pytest.raises(CheckpointError, match="target_modules: checkpoint .* vs job \\['q_proj', 'v_proj'\\]"):
        check_lora_config(adapter, LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]),
                          three_layers(["q_proj", "v_proj"]))
    with pytest.raises(CheckpointError, match="vs job all-linear"):  # without the model: not provable
        check_lora_config(adapter, LoraSpec(r=4, alpha=8, target_modules="all-linear"))


def test_rng_state_survives_a_checkpoint(tmp_path, trained):
    random.seed(11), np.random.seed(12), torch.manual_seed(13)
    rng_state, rng_tensors = capture_rng()
    first = (torch.rand(5), random.random(), np.random.rand(3), torch.randn(2))
    path = save_checkpoint(tmp_path / "step-00000002", model=trained[0], optimizer=trained[1],
                           state={"step": 2, "rng": rng_state}, tensors=rng_tensors)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)

    ckpt = load_checkpoint(path)
    restore_rng(ckpt.state["rng"], ckpt.tensors)
    again = (torch.rand(5), random.random(), np.random.rand(3), torch.randn(2))
    assert torch.equal(first[0], again[0]) and first[1] == again[1]
    assert np.array_equal(first[2], again[2]) and torch.equal(first[3], again[3])


def test_no_pickle_files_are_written(tmp_path, trained):
    path = save(tmp_path / "step-00000002", *trained)
    files = [p.name for p in path.rglob("*") if p.is_file()]
    assert files and not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl", ".pickle"))]


def test_reference_adapter_is_saved_flat(tmp_path, trained):
    model, optimizer = trained
    model.add_adapter("reference", lora_config(r=2, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".reference." in name:
                p.normal_()
    ckpt = load_checkpoint(save(tmp_path / "step-00000002", model, optimizer, reference_adapter="reference"))
    assert ckpt.reference_dir == ckpt.path / "reference"
    assert {p.name for p in ckpt.reference_dir.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((ckpt.reference_dir / "adapter_config.json").read_text())["r"] == 2
    assert json.loads((ckpt.adapter_dir / "adapter_config.json").read_text())["r"] == 4
    ref = PeftModel.from_pretrained(make_base(), ckpt.reference_dir)
    want = {n.replace(".reference.", ".default."): p for n, p in lora_weights(model).items() if ".reference." in n}
    assert want and want.keys() == lora_weights(ref).keys()
    for name, value in lora_weights(ref).items():
        assert torch.equal(value, want[name]), name
    assert load_checkpoint(save(tmp_path / "step-00000003", model, optimizer, step=3)).reference_dir is None


def test_an_unknown_reference_adapter_is_refused(tmp_path, trained):
    with pytest.raises(CheckpointError, match="'missing'"):
        save(tmp_path / "step-00000002", *trained, reference_adapter="missing")
    assert list(tmp_path.iterdir()) == []


def test_a_tampered_manifest_path_is_refused(tmp_path, trained):
    path = save(tmp_path / "step-00000002", *trained)
    manifest = json.loads((path / "manifest.json").read_text())
    shutil.copy(path / "trainer_state.json", tmp_path / "outside.json")
    manifest["files"]["../outside.json"] = manifest["files"]["trainer_state.json"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        load_checkpoint(path)


def test_a_failed_first_save_raises_its_own_error_and_leaves_nothing(tmp_path, trained):
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        save_checkpoint(tmp_path / "step-00000001", model=trained[0], optimizer=trained[1], state={"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_a_save_that_fails_after_moving_the_old_checkpoint_aside_puts_it_back(tmp_path, trained, monkeypatch):
    path = save(tmp_path / "step-00000002", *trained)
    rename = Path.rename

    def failing(self, target):
        if self.name.startswith(".tmp-"):  # the finished new checkpoint, about to take the old one's place
            raise OSError("rename failed")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(OSError, match="rename failed"):
        save_checkpoint(path, model=trained[0], optimizer=trained[1], state={"step": 3})
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002"]
    assert load_checkpoint(path).state == {"step": 2}


def test_a_checkpoint_folder_is_made_with_its_parents(tmp_path, trained):
    path = save(tmp_path / "job" / "checkpoints" / "step-00000002", *trained)
    assert load_checkpoint(path).state == {"step": 2}


def test_a_reference_adapter_is_saved_from_the_state_dict_handed_in(tmp_path, trained):
    """Under FSDP the model's own weights are shards: the gathered model_state is what reference/ must hold."""
    from safetensors.torch import load_file

    model, optimizer = trained
    model.add_adapter("reference", lora_config(r=2, target_modules=["q_proj"]))
    given = {k: torch.full_like(v, 0.75) for k, v in model.state_dict().items()}
    ckpt = load_checkpoint(save(tmp_path / "step-00000002", model, optimizer, reference_adapter="reference",
                                model_state=given))
    saved = load_file(ckpt.reference_dir / "adapter_model.safetensors")
    assert saved and all(torch.all(t == 0.75) for t in saved.values())
