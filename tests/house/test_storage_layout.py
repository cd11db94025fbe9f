"""The object store's layout has one home, service/storage_layout.py: the worker writes checkpoints where the API
reads them because both take every name and prefix from it, and no other module spells one of them out."""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

from service import storage_layout as layout
from service.storage import LocalStore
from worker.checkpoints.artifacts import delete_unreferenced, upload_checkpoint

REPO = Path(__file__).resolve().parents[2]
NAMES = {layout.MANIFEST, layout.ARCHIVE, layout.MERGED_ARCHIVE}


def _spelled_out(path: Path) -> list[str]:
    """The layout's file names as string constants, and f-strings that build a checkpoint prefix by hand."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value in NAMES:
            found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if "/checkpoints" in text and text.startswith("jobs/"):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_layout_module_spells_out_the_stored_names_and_prefixes():
    spelled = {str(p.relative_to(REPO)): s for root in ("service", "worker") for p in sorted((REPO / root).rglob("*.py"))
               if p != REPO / "service" / "storage_layout.py" and (s := _spelled_out(p))}
    assert not spelled, spelled


def test_the_check_finds_a_name_or_a_prefix_spelled_out(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('A = "adapter.tar"\nB = f"jobs/{job}/checkpoints/epoch-{e:06d}"\nC = f"{x}-adapter.tar"\n')
    assert [s.split(":")[0] for s in _spelled_out(src)] == ["1", "2"]


def _checkpoint(root: Path, name: str) -> Path:
    ckpt = root / name
    (ckpt / "adapter").mkdir(parents=True)
    (ckpt / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    files = {"adapter/adapter_model.safetensors": {"sha256": hashlib.sha256(b"weights").hexdigest(), "bytes": 7}}
    (ckpt / layout.MANIFEST).write_text(json.dumps({"files": files}))
    return ckpt


def test_an_uploaded_checkpoint_lands_where_the_layout_says(tmp_path):
    store = LocalStore(tmp_path / "store")
    prefix, files = upload_checkpoint(store, "ftjob-1", 3, _checkpoint(tmp_path, "step-00000010"))
    assert prefix == layout.checkpoint_prefix("ftjob-1", 3, "step-00000010")
    assert prefix.startswith(layout.run_checkpoints("ftjob-1", 3) + "/")
    assert layout.run_checkpoints("ftjob-1", 3).startswith(layout.job_checkpoints("ftjob-1") + "/")
    assert len(prefix.split("/")) == layout.CHECKPOINT_PREFIX_DEPTH
    assert {layout.ARCHIVE, layout.MANIFEST} <= set(files)
    assert sorted(store.list(prefix)) == sorted(f"{prefix}/{rel}" for rel in files)
    # an upload no row points at is found by the same prefix arithmetic, and only it
    other, _ = upload_checkpoint(store, "ftjob-1", 4, _checkpoint(tmp_path / "b", "step-00000020"))
    assert delete_unreferenced(store, layout.job_checkpoints("ftjob-1"), {prefix}) == [other]
    assert store.list(layout.run_checkpoints("ftjob-1", 4)) == [] and store.list(prefix)
