"""Trainer checkpoints that resume a job exactly and can be trusted when loaded.

- No pickle: a checkpoint can arrive from outside (``init_from``), and
  unpickling executes code. Tensors go to safetensors, everything else to JSON.
- Manifest last: ``manifest.json`` lists every file with its sha256 and is
  written after everything else, so a directory with a manifest is complete,
  and a corrupted file is refused before anything from it is used.
- Atomic rename: a checkpoint is built in a hidden sibling directory and renamed
  into place, so a crash never leaves a half-written ``step-NNNNNNNN``.

A LoRA job's checkpoint holds ``adapter/`` (PEFT's format; float32, as the
adapters train); a full fine-tuning job's holds ``model/`` (config +
safetensors, loadable with from_pretrained) in the job's dtype, and then, when
that is below float32, the float32 master weights among the trainer-state
tensors (``master.*``) so a resume continues from exactly the same weights.
Either may hold ``reference/`` in the same format, the pinned reference policy.
Weights and optimizer state are always whole (gathered from every FSDP rank),
so a checkpoint resumes at any number of processes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from service.job_spec.spec import LoraSpec
from service.storage_layout import MANIFEST

try:  # optional: only its global RNG is checkpointed
    import numpy as np
except ImportError:
    np = None

FORMAT = 1
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
REQUIRED = (STATE_JSON, STATE_TENSORS)
ADAPTER_FILES = ("adapter/adapter_config.json", "adapter/adapter_model.safetensors")
MODEL_CONFIG = "model/config.json"
_OPT = "optimizer.state."  # prefix of optimizer tensors, in the file and in Checkpoint.tensors
_USER = "user."  # prefix of the caller's tensors in the file only
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted, or does not fit the job."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    adapter_dir: Path | None  # a LoRA job's adapter; None in a full fine-tuning checkpoint
    reference_dir: Path | None
    state: dict
    tensors: dict[str, torch.Tensor]
    # param_groups and non-tensor optimizer state; kept apart so the caller's state stays exactly theirs.
    optimizer: dict | None = field(default=None, repr=False)
    model_dir: Path | None = None  # a full fine-tuning job's whole model (from_pretrained loads it)


def checkpoint_name(step: int) -> str:
    return "step-%08d" % step


def save_checkpoint(path: Path, *, model, optimizer: torch.optim.Optimizer | dict | None, state: dict,
                    tensors: dict[str, torch.Tensor] | None = None,
                    reference_adapter: str | None = None, model_state: dict[str, torch.Tensor] | None = None,
                    reference_state: dict[str, torch.Tensor] | None = None, tokenizer=None) -> Path:
    """Write a checkpoint of `model` (a PeftModel: its adapter; otherwise the whole model).

    `optimizer` is an optimizer or its state_dict(); `model_state` and `reference_state` are whole state dicts
    that replace model.state_dict() (an FSDP model's, gathered to this rank) and, for full fine-tuning,
    the pinned reference's. `tokenizer` is saved with a whole model, so the folder loads on its own.
    """
    path = Path(path)
    tensors = dict(tensors or {})
    if not hasattr(model, "peft_config"):
        if reference_adapter is not None:
            raise CheckpointError("a reference adapter needs a LoRA model; pass reference_state for a whole model")
    elif reference_adapter is not None and (reference_adapter == "default" or reference_adapter not in model.peft_config):
        raise CheckpointError(f"reference adapter {reference_adapter!r} is not a loaded adapter other than 'default' "
                              f"(loaded: {sorted(model.peft_config)})")
    if clash := [k for k in tensors if k.startswith(_OPT)]:
        raise CheckpointError(f"tensor names {clash} use the reserved prefix {_OPT!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex}"
    tmp.mkdir()
    old = None
    try:
        _write_weights(tmp, model, reference_adapter, model_state, reference_state, tokenizer)
        _write_contents(tmp, optimizer, state, tensors)
        if path.exists():
            # Move the old one aside rather than deleting it first: until the rename below,
            # a crash then leaves no step directory at all, never a half-written one.
            old = path.parent / f".old-{path.name}-{uuid.uuid4().hex}"
            path.rename(old)
        tmp.rename(path)
        fsync_dir(path.parent)
    except BaseException:
        if old is not None and not path.exists():
            old.rename(path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _write_weights(tmp: Path, model, reference_adapter, model_state, reference_state, tokenizer) -> None:
    if not hasattr(model, "peft_config"):  # full fine-tuning: the whole model, as from_pretrained reads it
        # Taken before saving: save_pretrained empties the state dict it is given (transformers 5).
        model_dtype, reference_dtype = _held_dtype(model_state), _held_dtype(reference_state)
        model.save_pretrained(tmp / "model", state_dict=model_state, safe_serialization=True)
        _record_dtype(tmp / "model", model_dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        if reference_state is not None:
            model.save_pretrained(tmp / "reference", state_dict=reference_state, safe_serialization=True)
            _record_dtype(tmp / "reference", reference_dtype)
        if not (tmp / MODEL_CONFIG).is_file():
            raise CheckpointError(f"{type(model).__name__}.save_pretrained wrote no config.json")
        return
    with _without_model_card(model):
        model.save_pretrained(tmp / "adapter", selected_adapters=["default"], safe_serialization=True,
                              state_dict=model_state)
        if reference_adapter is not None:
            # PEFT nests every adapter not named "default" in a subfolder named after it, so save to scratch and
            # lift the subfolder out.
            scratch = tmp / ".reference-scratch"
            model.save_pretrained(scratch, selected_adapters=[reference_adapter], safe_serialization=True,
                                  state_dict=model_state)
            (scratch / reference_adapter).rename(tmp / "reference")
            shutil.rmtree(scratch)
    if not (tmp / "adapter" / "adapter_model.safetensors").is_file():
        raise CheckpointError(f"{type(model).__name__}.save_pretrained wrote no adapter_model.safetensors")


@contextmanager
def _without_model_card(model):
    """PEFT's save_pretrained without its README.md: a template of "[More Information Needed]" fields that
    PEFT and vLLM never read, whose Jinja compile cost ~20 ms a checkpoint (most of a small adapter's save). An
    adapter directory then holds what a shared worker's holds (worker/multi/checkpoints.py), file for file."""
    model.create_or_update_model_card = lambda *_args, **_kwargs: None  # shadows the method on this instance
    try:
        yield
    finally:
        del model.create_or_update_model_card


def _held_dtype(state: dict[str, torch.Tensor] | None) -> torch.dtype | None:
    """The one floating dtype of a state dict's tensors; None when there are none, or several."""
    dtypes = {v.dtype for v in (state or {}).values() if v.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def _record_dtype(model_dir: Path, dtype: torch.dtype | None) -> None:
    """config.json's dtype as the files hold it: save_pretrained writes the live model's (float32 master weights)."""
    if dtype is None:
        return
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_contents(tmp: Path, optimizer, state, tensors) -> None:
    flat, opt_meta = {_USER + k: v for k, v in tensors.items()}, None
    if optimizer is not None:
        sd = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
        opt_meta = {"param_groups": sd["param_groups"], "scalars": {}}
        for idx, pstate in sd["state"].items():
            for name, value in pstate.items():
                if isinstance(value, torch.Tensor):
                    flat[f"{_OPT}{idx}.{name}"] = value
                else:  # e.g. a float 'step' in some optimizers
                    opt_meta["scalars"].setdefault(str(idx), {})[name] = value
    # safetensors refuses views and shared storage; copies on CPU sidestep both.
    save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in flat.items()}, tmp / STATE_TENSORS)
    try:
        text = json.dumps({"format": FORMAT, "state": state, "optimizer": opt_meta}, indent=1)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{STATE_JSON}: trainer state is not JSON-serialisable: {e}") from None
    (tmp / STATE_JSON).write_text(text)
    files = {f.relative_to(tmp).as_posix(): {"sha256": file_sha256(f, fsync=True), "bytes": f.stat().st_size}
             for f in sorted(tmp.rglob("*")) if f.is_file()}
    for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        fsync_dir(d)
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"format": FORMAT, "files": files, "step": state.get("step")}, indent=1))
    file_sha256(manifest, fsync=True)
    fsync_dir(tmp)


def load_checkpoint(path: Path) -> Checkpoint:
    path = Path(path)

    def fail(msg: str):
        raise CheckpointError(f"checkpoint {path.name}: {msg}")
    if not path.is_dir():
        fail(f"{path} is not a directory")
    if not (path / MANIFEST).is_file():
        fail(f"no {MANIFEST} in {path}: the save did not finish, or this is not a checkpoint")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files, version = manifest["files"], manifest["format"]
    except (ValueError, KeyError, TypeError) as e:
        fail(f"{MANIFEST} is unreadable: {e!r}")
    if version != FORMAT:
        fail(f"{MANIFEST} has format {version!r}, this code reads format {FORMAT}")
    if absent := [rel for rel in REQUIRED if rel not in files]:
        fail(f"{MANIFEST} does not list {', '.join(absent)}")
    full = MODEL_CONFIG in files
    if not full and (absent := [rel for rel in ADAPTER_FILES if rel not in files]):
        fail(f"{MANIFEST} lists neither {MODEL_CONFIG} (a whole model) nor {', '.join(absent)} (an adapter)")
    for rel, meta in files.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            fail(f"{MANIFEST} lists a path outside the checkpoint: {rel!r}")
        target = path / rel
        if not target.is_file():
            fail(f"{rel} is missing")
        if (size := target.stat().st_size) != meta.get("bytes"):
            fail(f"{rel} is {size} bytes (expected {meta.get('bytes')})")
        if (digest := file_sha256(target)) != meta.get("sha256"):
            fail(f"{rel} sha256 mismatch (expected {meta.get('sha256')}, got {digest})")
    doc = json.loads((path / STATE_JSON).read_text())
    tensors = {k.removeprefix(_USER): v for k, v in load_file(path / STATE_TENSORS).items()}
    has_reference = ("reference/config.json" if full else "reference/adapter_config.json") in files
    reference = path / "reference" if has_reference else None
    return Checkpoint(path, None if full else path / "adapter", reference, doc["state"], tensors,
                      doc.get("optimizer"), model_dir=path / "model" if full else None)


def load_optimizer_state(optimizer, checkpoint: Checkpoint) -> None:
    optimizer.load_state_dict(optimizer_state_dict(optimizer, checkpoint))


def optimizer_state_dict(optimizer, checkpoint: Checkpoint) -> dict:
    """The checkpoint's optimizer state as optimizer.state_dict() lays it out, checked against `optimizer`."""
    def fail(msg: str):
        raise CheckpointError(f"checkpoint {checkpoint.path.name}: {msg}")
    meta = checkpoint.optimizer
    if meta is None:
        fail("holds no optimizer state")
    # JSON turned tuples (AdamW betas) into lists; torch optimizers expect tuples back.
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
              for g in meta["param_groups"]]
    if len(groups) != len(optimizer.param_groups):
        fail(f"{len(groups)} optimizer param groups, the optimizer has {len(optimizer.param_groups)}")
    params = {}
    for i, (saved, current) in enumerate(zip(groups, optimizer.param_groups)):
        if len(saved["params"]) != len(current["params"]):
            fail(f"param group {i} has {len(saved['params'])} parameters, the optimizer {len(current['params'])}")
        params.update(zip(saved["params"], current["params"]))
    state: dict[int, dict] = {}
    for key, value in checkpoint.tensors.items():
        if not key.startswith(_OPT):
            continue
        idx, name = key[len(_OPT):].split(".", 1)
        param = params.get(int(idx))
        if param is None:
            fail(f"optimizer state for parameter {idx}, which no param group lists")
        # Moments (exp_avg, momentum_buffer) have the parameter's shape; counters are scalars.
        if value.dim() > 0 and value.shape != param.shape:
            fail(f"optimizer {name} of parameter {idx} has shape {tuple(value.shape)}, "
                 f"the parameter {tuple(param.shape)}")
        # torch only shallow-copies on load; a clone keeps the optimizer from mutating checkpoint.tensors.
        state.setdefault(int(idx), {})[name] = value.clone()
    for idx, values in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(values)
    return {"state": state, "param_groups": groups}


def check_lora_config(adapter_dir: Path, lora: LoraSpec, model=None, adapter_name: str = "default") -> None:
    """The checkpoint's adapter has the job's rank, alpha, dropout and target modules. ``model``: the job's
    PeftModel with its adapter ``adapter_name`` in place, when at hand; then targets that are written differently
    pass if they select exactly the modules the job's adapter wraps (PEFT writes an all-linear adapter of 20 or
    more layers as the shortest suffixes that select them, e.g. Llama's seven `*_proj` names)."""
    config_path = Path(adapter_dir) / "adapter_config.json"
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_path}: cannot read the adapter config: {e}") from None
    if cfg.get("peft_type") != "LORA":
        raise CheckpointError(f"{config_path}: peft_type is {cfg.get('peft_type')!r}, not 'LORA'")
    problems = []
    for key, job in (("r", lora.r), ("lora_alpha", lora.alpha), ("lora_dropout", lora.dropout)):
        ours = cfg.get(key)
        if not isinstance(ours, (int, float)) or not math.isclose(ours, job, rel_tol=1e-9, abs_tol=1e-12):
            problems.append(f"{key}: checkpoint {ours} vs job {job}")
    theirs, job = cfg.get("target_modules"), lora.target_modules
    if not _same_targets(theirs, job) and not (model is not None and _selects_the_wrapped(theirs, model,
                                                                                          adapter_name)):
        shown = sorted(theirs) if isinstance(theirs, list) else theirs
        problems.append(f"target_modules: checkpoint {shown} vs job {sorted(job) if isinstance(job, list) else job}")
    if problems:
        raise CheckpointError(f"adapter {adapter_dir} does not match the job's lora spec: " + "; ".join(problems))


def _same_targets(theirs, job) -> bool:
    # PEFT expands "all-linear" into the full dotted name of every linear layer before saving,
    # so dotted names are what an all-linear adapter looks like on disk.
    if job == "all-linear":
        return theirs == "all-linear" or (isinstance(theirs, list) and all("." in t for t in theirs))
    if not isinstance(theirs, list):
        return False
    # PEFT matches a target name against module names by dotted suffix; compare the same way.
    def hit(a: str, b: str) -> bool:
        return a == b or a.endswith("." + b) or b.endswith("." + a)
    return all(any(hit(t, j) for j in job) for t in theirs) and all(any(hit(t, j) for t in theirs) for j in job)


def _selects_the_wrapped(theirs, model, adapter_name: str) -> bool:
    """Whether target names (matched as PEFT matches them: the whole module name or a dotted suffix of it)
    select exactly the modules that carry `adapter_name` in `model`."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(theirs, list) or not theirs:
        return False
    wrapped = {n for n, m in model.named_modules() if isinstance(m, LoraLayer) and adapter_name in m.lora_A}
    selected = {n for n, _ in model.named_modules() if any(n == t or n.endswith("." + t) for t in theirs)}
    return bool(wrapped) and selected == wrapped


def capture_rng() -> tuple[dict, dict[str, torch.Tensor]]:
    version, internal, gauss = random.getstate()
    state: dict = {"python": [version, list(internal), gauss]}
    tensors = {"rng.torch": torch.get_rng_state()}
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
        tensors["rng.numpy.keys"] = torch.from_numpy(keys.astype(np.int64))
    if torch.cuda.is_available():
        cuda = torch.cuda.get_rng_state_all()
        state["cuda_devices"] = len(cuda)
        tensors.update({f"rng.cuda.{i}": s for i, s in enumerate(cuda)})
    return state, tensors


def restore_rng(state: dict, tensors: dict[str, torch.Tensor]) -> None:
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(tensors["rng.torch"])
        if "numpy" in state and np is not None:
            n = state["numpy"]
            keys = tensors["rng.numpy.keys"].numpy().astype(np.uint32)
            np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached"]))
        saved = state.get("cuda_devices", 0)
        here = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if saved != here:
            # Resuming on other hardware is allowed; only the sampling stream differs.
            warnings.warn(f"RNG state saved for {saved} CUDA devices, restoring on {here}", stacklevel=2)
        for i in range(min(saved, here)):
            torch.cuda.set_rng_state(tensors[f"rng.cuda.{i}"], i)
    except KeyError as e:
        raise CheckpointError(f"RNG state lacks {e.args[0]!r}") from None


def latest_checkpoint(root: Path) -> Path | None:
    root = Path(root)
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), d) for d in root.iterdir()
             if (m := _STEP_DIR.match(d.name)) and (d / MANIFEST).is_file()]
    return max(found)[1] if found else None


def file_sha256(path: Path, fsync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a directory's fsync makes its renames and new entries durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
