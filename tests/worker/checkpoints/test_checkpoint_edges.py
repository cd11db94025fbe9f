"""Checkpoints beyond the LoRA round trip: whole-model saves, every refusal of a bad manifest or optimizer
state, adapter-config matching by dotted suffix, and RNG state that cannot be restored."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from service.job_spec.spec import LoraSpec
from tests.worker.checkpoints.test_checkpoint import make_base, make_optimizer, save, train_step, trained  # noqa: F401
from worker.checkpoints.checkpoint import (
    CheckpointError,
    capture_rng,
    check_lora_config,
    load_checkpoint,
    optimizer_state_dict,
    restore_rng,
    save_checkpoint,
)


class Tokenizer:
    def save_pretrained(self, folder):
        Path(folder, "tokenizer_config.json").write_text('{"model_max_length": 64}')


def test_a_whole_model_checkpoint_loads_with_from_pretrained_in_the_dtype_it_holds(tmp_path):
    model = make_base()
    optimizer = make_optimizer(model)
    train_step(model, optimizer, 1)
    weights = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    pinned = {k: v.clone() for k, v in make_base(seed=5).state_dict().items()}
    # save_pretrained empties the dicts it is given (transformers 5): hand it copies.
    path = save_checkpoint(tmp_path / "step-00000001", model=model, optimizer=optimizer, state={"step": 1},
                           model_state=dict(weights), reference_state=dict(pinned), tokenizer=Tokenizer())
    ckpt = load_checkpoint(path)
    assert (ckpt.adapter_dir, ckpt.model_dir, ckpt.reference_dir) == (None, path / "model", path / "reference")
    # config.json says what the files hold (the live model is float32), so from_pretrained's "auto" is right.
    assert json.loads((path / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((path / "reference" / "config.json").read_text())["dtype"] == "float32"
    assert json.loads((path / "model" / "tokenizer_config.json").read_text()) == {"model_max_length": 64}
    assert "model/tokenizer_config.json" in json.loads((path / "manifest.json").read_text())["files"]
    for folder, want in ((ckpt.model_dir, weights), (ckpt.reference_dir, pinned)):
        loaded = LlamaForCausalLM.from_pretrained(folder, torch_dtype="auto").state_dict()
        assert loaded.keys() == want.keys()
        assert all(torch.equal(loaded[k], want[k]) for k in want), folder
    # Without a pinned reference there is no reference folder.
    assert load_checkpoint(save(tmp_path / "step-00000002", model, optimizer)).reference_dir is None


def test_mixed_dtypes_leave_config_dtype_as_saved(tmp_path):
    model = make_base()
    weights = {k: (v if "norm" in k else v.to(torch.bfloat16)) for k, v in model.state_dict().items()}
    path = save_checkpoint(tmp_path / "step-00000001", model=model, optimizer=None, state={"step": 1},
                           model_state=weights)
    assert json.loads((path / "model" / "config.json").read_text())["dtype"] == "float32"


def test_a_reference_adapter_needs_a_lora_model_other_than_default(tmp_path, trained):  # noqa: F811
    with pytest.raises(CheckpointError, match="^a reference adapter needs a LoRA model; pass reference_state for a whole model$"):
        save(tmp_path / "step-00000001", make_base(), None, reference_adapter="reference")
    with pytest.raises(CheckpointError, match="'default' is not a loaded adapter other than 'default'"):
        save(tmp_path / "step-00000001", *trained, reference_adapter="default")
    assert list(tmp_path.iterdir()) == []


def test_tensors_in_the_optimizer_s_namespace_are_refused(tmp_path, trained):  # noqa: F811
    with pytest.raises(CheckpointError, match=r"\['optimizer.state.0.exp_avg'\] use the reserved prefix"):
        save(tmp_path / "step-00000001", *trained, tensors={"optimizer.state.0.exp_avg": torch.zeros(2)})
    assert list(tmp_path.iterdir()) == []


def _edit_manifest(path: Path, edit) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(format=2), "manifest.json has format 2, this code reads format 1"),
    (lambda m: m.pop("files"), "manifest.json is unreadable: KeyError"),
    (lambda m: m["files"].pop("trainer_state.json"), "manifest.json does not list trainer_state.json$"),
    (lambda m: m["files"].pop("adapter/adapter_config.json"),
     "manifest.json lists neither model/config.json .a whole model. nor adapter/adapter_config.json .an adapter."),
    (lambda m: m["files"]["trainer_state.json"].update(bytes=1), r"trainer_state.json is \d+ bytes \(expected 1\)"),
])
def test_a_manifest_that_does_not_describe_a_checkpoint_is_refused(tmp_path, trained, edit, message):  # noqa: F811
    path = save(tmp_path / "step-00000002", *trained)
    _edit_manifest(path, edit)
    with pytest.raises(CheckpointError, match="checkpoint step-00000002: " + message):
        load_checkpoint(path)


def test_an_unparsable_manifest_or_a_file_is_refused(tmp_path, trained):  # noqa: F811
    path = save(tmp_path / "step-00000002", *trained)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is unreadable"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_checkpoint(path / "trainer_state.json")


def test_optimizer_state_keeps_scalars_and_refuses_what_does_not_fit(tmp_path, trained):  # noqa: F811
    model, optimizer = trained
    sd = optimizer.state_dict()
    sd["state"][0]["step"] = 2.0  # some optimizers keep a float, not a tensor
    ckpt = load_checkpoint(save(tmp_path / "step-00000002", model, sd))
    assert ckpt.optimizer["scalars"] == {"0": {"step": 2.0}}
    restored = optimizer_state_dict(make_optimizer(model), ckpt)
    assert restored["state"][0]["step"] == 2.0
    assert torch.equal(restored["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
    assert set(restored["state"]) == {0, 1, 2, 3}

    params = [p for p in model.parameters() if p.requires_grad]
    two_groups = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    with pytest.raises(CheckpointError, match="1 optimizer param groups, the optimizer has 2"):
        optimizer_state_dict(two_groups, ckpt)

    sd = optimizer.state_dict()
    sd["state"][99] = {"exp_avg": torch.zeros(1)}
    ckpt = load_checkpoint(save(tmp_path / "step-00000003", model, sd, step=3))
    with pytest.raises(CheckpointError, match="optimizer state for parameter 99, which no param group lists"):
        optimizer_state_dict(make_optimizer(model), ckpt)


def _adapter(tmp_path, **cfg) -> Path:
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
              "target_modules": ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"], **cfg}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    return tmp_path


def test_adapter_targets_match_by_dotted_suffix_both_ways(tmp_path):
    adapter = _adapter(tmp_path)
    check_lora_config(adapter, LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    check_lora_config(adapter, LoraSpec(r=4, alpha=8, target_modules=["self_attn.q_proj", "self_attn.v_proj"]))
    for job in (["q_proj"], ["q_proj", "v_proj", "k_proj"], ["_proj"]):
        with pytest.raises(CheckpointError, match="target_modules"):
            check_lora_config(adapter, LoraSpec(r=4, alpha=8, target_modules=job))
    check_lora_config(_adapter(tmp_path, target_modules=["q_proj", "v_proj"]),
                      LoraSpec(r=4, alpha=8, target_modules=["model.layers.0.self_attn.q_proj", "v_proj"]))
    with pytest.raises(CheckpointError, match="target_modules: checkpoint all-linear vs job"):
        check_lora_config(_adapter(tmp_path, target_modules="all-linear"),
                          LoraSpec(r=4, alpha=8, target_modules=["q_proj"]))
    # "all-linear" only matches dotted names (PEFT's expansion), not a short list.
    with pytest.raises(CheckpointError, match="vs job all-linear"):
        check_lora_config(_adapter(tmp_path, target_modules=["q_proj", "v_proj"]),
                          LoraSpec(r=4, alpha=8, target_modules="all-linear"))


def test_an_adapter_config_that_is_not_lora_or_unreadable_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="peft_type is 'IA3', not 'LORA'"):
        check_lora_config(_adapter(tmp_path, peft_type="IA3"), LoraSpec(r=4, alpha=8))
    with pytest.raises(CheckpointError, match="r: checkpoint four vs job 4"):
        check_lora_config(_adapter(tmp_path, r="four"), LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    (tmp_path / "adapter_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="cannot read the adapter config"):
        check_lora_config(tmp_path, LoraSpec(r=4, alpha=8))
    with pytest.raises(CheckpointError, match="cannot read the adapter config"):
        check_lora_config(tmp_path / "absent", LoraSpec(r=4, alpha=8))


def test_rng_state_that_is_incomplete_or_from_other_hardware(monkeypatch):
    state, tensors = capture_rng()
    with pytest.raises(CheckpointError, match="RNG state lacks 'rng.torch'"):
        restore_rng(state, {})
    with pytest.raises(CheckpointError, match="RNG state lacks 'python'"):
        restore_rng({}, tensors)
    if torch.cuda.is_available():
        pytest.skip("the other-hardware case is checked on a CPU-only machine")
    with pytest.warns(UserWarning, match="RNG state saved for 2 CUDA devices, restoring on 0"):
        restore_rng({**state, "cuda_devices": 2}, tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restore_rng(state, tensors)  # same hardware: silent


def test_refusals_name_every_absent_file_and_the_digest_expected(tmp_path, trained):  # noqa: F811
    """A manifest missing several files names all of them; a corrupt file's refusal shows the recorded digest."""
    path = save(tmp_path / "step-00000002", *trained)
    _edit_manifest(path, lambda m: [m["files"].pop(rel) for rel in ("trainer_state.json", "trainer_state.safetensors")])
    with pytest.raises(CheckpointError, match="does not list trainer_state.json, trainer_state.safetensors$"):
        load_checkpoint(path)
    path = save(tmp_path / "step-00000003", *trained, step=3)
    _edit_manifest(path, lambda m: [m["files"].pop(rel) for rel in ("adapter/adapter_config.json",
                                                                    "adapter/adapter_model.safetensors")])
    with pytest.raises(CheckpointError, match=r"nor adapter/adapter_config.json, adapter/adapter_model.safetensors "):
        load_checkpoint(path)
    path = save(tmp_path / "step-00000004", *trained, step=4)
    recorded = json.loads((path / "manifest.json").read_text())["files"]["trainer_state.json"]["sha256"]
    (path / "trainer_state.json").write_text((path / "trainer_state.json").read_text() + " ")
    _edit_manifest(path, lambda m: m["files"]["trainer_state.json"].update(
        bytes=(path / "trainer_state.json").stat().st_size))
    with pytest.raises(CheckpointError, match=rf"trainer_state.json sha256 mismatch \(expected {recorded}, got "):
        load_checkpoint(path)


def test_optimizer_state_absent_or_of_another_shape_is_refused(tmp_path, trained):  # noqa: F811
    model, optimizer = trained
    ckpt = load_checkpoint(save_checkpoint(tmp_path / "step-00000001", model=model, optimizer=None,
                                           state={"step": 1}))
    with pytest.raises(CheckpointError, match="step-00000001: holds no optimizer state$"):
        optimizer_state_dict(make_optimizer(model), ckpt)
    sd = optimizer.state_dict()
    sd["state"][0]["exp_avg"] = torch.zeros(3)  # a vector where the parameter is a matrix
    ckpt = load_checkpoint(save(tmp_path / "step-00000002", model, sd))
    with pytest.raises(CheckpointError, match="shape"):
        optimizer_state_dict(make_optimizer(model), ckpt)


def test_an_adapter_checkpoint_holds_the_trained_adapter_only(tmp_path, trained):  # noqa: F811
    """With a reference adapter beside it, adapter/ still holds the one trained adapter, flat, as PEFT loads it."""
    from tests.worker.checkpoints.test_checkpoint import lora_config

    model, optimizer = trained
    model.add_adapter("reference", lora_config(r=2, target_modules=["q_proj"]))
    ckpt = load_checkpoint(save(tmp_path / "step-00000002", model, optimizer, reference_adapter="reference"))
    assert not [p for p in ckpt.adapter_dir.iterdir() if p.is_dir()]  # PEFT puts other adapters in subfolders
    assert json.loads((ckpt.adapter_dir / "adapter_config.json").read_text())["r"] == 4


def test_a_bf16_reference_model_is_recorded_as_bf16(tmp_path):
    model = make_base()
    pinned = {k: v.to(torch.bfloat16) for k, v in make_base(seed=5).state_dict().items()}
    path = save_checkpoint(tmp_path / "step-00000001", model=model, optimizer=None, state={"step": 1},
                           model_state=dict(model.state_dict()), reference_state=dict(pinned))
    assert json.loads((path / "reference" / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((path / "model" / "config.json").read_text())["dtype"] == "float32"


def test_a_parameter_whose_optimizer_state_is_only_scalars_keeps_them(tmp_path, trained):  # noqa: F811
    model, optimizer = trained
    sd = optimizer.state_dict()
    sd["state"][1] = {"step": 5.0}  # no moment tensors for this one
    restored = optimizer_state_dict(make_optimizer(model), load_checkpoint(save(tmp_path / "step-00000002", model, sd)))
    assert restored["state"][1] == {"step": 5.0}


def test_adapter_config_mismatches_are_listed_sorted_and_all_linear_matches_itself(tmp_path):
    check_lora_config(_adapter(tmp_path, target_modules="all-linear"), LoraSpec(r=4, alpha=8, target_modules="all-linear"))
    adapter = _adapter(tmp_path, target_modules=["v_proj", "q_proj"])
    with pytest.raises(CheckpointError) as err:
        check_lora_config(adapter, LoraSpec(r=8, alpha=8, target_modules=["k_proj"]))
    assert str(err.value) == (f"adapter {adapter} does not match the job's lora spec: r: checkpoint 4 vs job 8; "
                              "target_modules: checkpoint ['q_proj', 'v_proj'] vs job ['k_proj']")


def test_rng_state_saved_without_numpy_restores_the_rest():
    state, tensors = capture_rng()
    first = torch.rand(3)
    restore_rng({"python": state["python"]}, {"rng.torch": tensors["rng.torch"]})
    assert torch.equal(torch.rand(3), first)


def test_the_state_dicts_handed_in_are_what_is_saved(tmp_path, trained):  # noqa: F811
    """model_state replaces the model's own weights (under FSDP those are shards): it is what the files hold."""
    from safetensors.torch import load_file

    model = make_base()
    given = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    whole = load_checkpoint(save_checkpoint(tmp_path / "step-00000001", model=model, optimizer=None, state={},
                                            model_state=dict(given)))
    assert all(torch.all(t == 0.5) for t in load_file(whole.model_dir / "model.safetensors").values())
    peft_model, _ = trained
    given = {k: torch.full_like(v, 0.25) for k, v in peft_model.state_dict().items()}
    adapter = load_checkpoint(save(tmp_path / "step-00000002", peft_model, None, model_state=given))
    saved = load_file(adapter.adapter_dir / "adapter_model.safetensors")
    assert saved and all(torch.all(t == 0.25) for t in saved.values())
    assert adapter.model_dir is None and whole.adapter_dir is None


def test_a_model_that_saves_no_config_is_refused_by_name(tmp_path):
    class Silent:
        def save_pretrained(self, folder, **kw):
            Path(folder).mkdir(parents=True, exist_ok=True)

    with pytest.raises(CheckpointError, match=r"^Silent.save_pretrained wrote no config.json$"):
        save_checkpoint(tmp_path / "step-00000001", model=Silent(), optimizer=None, state={})

    class SilentPeft(Silent):
        peft_config = {"default": None}

    with pytest.raises(CheckpointError, match=r"^SilentPeft.save_pretrained wrote no adapter_model.safetensors$"):
        save_checkpoint(tmp_path / "step-00000002", model=SilentPeft(), optimizer=None, state={})
