"""Moving checkpoints between the trainer's local directory and the object store.

Upload order is what makes a stored checkpoint trustworthy: every file
first, the adapter archive next, manifest.json last. Only after all of them
are stored does the worker record the checkpoint in SQL (fenced by its lease
epoch), so the database never points at a half-uploaded checkpoint; and
since every run uploads under its own epoch's prefix, no upload ever
replaces an object a committed checkpoint points at.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

from service.storage import ObjectStore

ARCHIVE = "adapter.tar"
MANIFEST = "manifest.json"


def checkpoint_prefix(job_id: str, epoch: int, checkpoint_dir: Path) -> str:
    """Each run (lease epoch) writes under its own prefix: a stale worker that wakes up after another
    took over its job uploads to a prefix nothing points at, never over a committed checkpoint."""
    return f"jobs/{job_id}/checkpoints/epoch-{epoch:06d}/{checkpoint_dir.name}"


def adapter_archive(adapter_dir: Path) -> bytes:
    """A byte-for-byte reproducible tar of the adapter (sorted names, zeroed times and owners)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in adapter_dir.rglob("*") if p.is_file()):
            info = tarfile.TarInfo(name=f"adapter/{path.relative_to(adapter_dir).as_posix()}")
            info.size = path.stat().st_size
            info.mode = 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
    return buf.getvalue()


def upload_checkpoint(store: ObjectStore, job_id: str, epoch: int, checkpoint_dir: Path) -> tuple[str, dict]:
    """Store a complete local checkpoint; returns (prefix, {relative path: {sha256, bytes}})."""
    prefix = checkpoint_prefix(job_id, epoch, checkpoint_dir)
    manifest = json.loads((checkpoint_dir / MANIFEST).read_text())
    files: dict[str, dict] = {}
    for rel, meta in sorted(manifest["files"].items()):
        sha = store.put_file(f"{prefix}/{rel}", checkpoint_dir / rel)
        if sha != meta["sha256"]:
            raise IOError(f"{rel} changed while it was uploaded")
        files[rel] = {"sha256": sha, "bytes": meta["bytes"]}
    archive = adapter_archive(checkpoint_dir / "adapter")
    files[ARCHIVE] = {"sha256": store.put_bytes(f"{prefix}/{ARCHIVE}", archive), "bytes": len(archive)}
    manifest_bytes = (checkpoint_dir / MANIFEST).read_bytes()
    files[MANIFEST] = {"sha256": store.put_bytes(f"{prefix}/{MANIFEST}", manifest_bytes), "bytes": len(manifest_bytes)}
    return prefix, files


def download_checkpoint(store: ObjectStore, prefix: str, files: dict, dest: Path) -> Path:
    """Fetch a stored checkpoint into dest (atomically); hashes are checked again when it loads."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    try:
        for rel, meta in files.items():
            if rel == ARCHIVE:
                continue
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            sha = store.get_file(f"{prefix}/{rel}", target)
            if sha != meta["sha256"]:
                raise IOError(f"stored checkpoint file {prefix}/{rel} has sha256 {sha}, expected {meta['sha256']}")
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def delete_unreferenced(store: ObjectStore, within: str, referenced: set[str]) -> list[str]:
    """Delete the checkpoint prefixes under `within` (a job's checkpoints, or one run's) that no checkpoint
    row points at: uploads a run made but never committed (it died, lost its lease, or met an outage
    mid-upload). Returns the prefixes deleted. Only for prefixes no live run still writes under."""
    depth = len(checkpoint_prefix("j", 0, Path("s")).split("/"))  # jobs/<id>/checkpoints/epoch-N/<step>
    orphans = sorted({"/".join(key.split("/")[:depth]) for key in store.list(within)} - referenced)
    for prefix in orphans:
        store.delete_prefix(prefix)
    return orphans
