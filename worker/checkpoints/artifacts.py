"""Moving checkpoints between the trainer's local directory and the object store.

Upload order is what makes a stored checkpoint trustworthy: every file
first, the archive next, manifest.json last. The archive (served as the
checkpoint's content) is the whole checkpoint, manifest included: unpacked,
it is a directory that `init_from` accepts, and its `adapter/` (or `model/`)
loads with PEFT (or from_pretrained) on its own. Only after all of them
are stored does the worker record the checkpoint in SQL (fenced by its lease
epoch), so the database never points at a half-uploaded checkpoint; and
since every run uploads under its own epoch's prefix, no upload ever
replaces an object a committed checkpoint points at.
"""

from __future__ import annotations

import json
import shutil
import tarfile
import tempfile
from pathlib import Path

from service.storage import ObjectStore
from service.storage_layout import (ARCHIVE, CHECKPOINT_PREFIX_DEPTH, MANIFEST, MERGED_ARCHIVE, MERGED_DIR,
                                    checkpoint_prefix)


def write_checkpoint_archive(checkpoint_dir: Path, dest: Path) -> None:
    """A byte-for-byte reproducible tar of every file the manifest lists, and the manifest (sorted names, zeroed
    times and owners), written to a file: a whole model's checkpoint may not fit in memory."""
    listed = json.loads((checkpoint_dir / MANIFEST).read_text())["files"]
    with tarfile.open(dest, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted([*listed, MANIFEST]):
            path = checkpoint_dir / rel
            info = tarfile.TarInfo(name=rel)
            info.size = path.stat().st_size
            info.mode = 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)


def upload_tree(store: ObjectStore, prefix: str, src: Path, archive_name: str, under: str = "") -> dict:
    """Store a directory with a sha256 manifest under prefix[/under]: each listed file, then one tar of it all at
    prefix/archive_name, then the manifest last (a stored manifest means a complete upload); returns the stored
    keys' {sha256, bytes}, relative to prefix."""
    sub = f"{under}/" if under else ""
    manifest = json.loads((src / MANIFEST).read_text())
    files: dict[str, dict] = {}
    for rel, meta in sorted(manifest["files"].items()):
        sha = store.put_file(f"{prefix}/{sub}{rel}", src / rel)
        if sha != meta["sha256"]:
            raise IOError(f"{sub}{rel} changed while it was uploaded")
        files[f"{sub}{rel}"] = {"sha256": sha, "bytes": meta["bytes"]}
    archive = src.parent / f".{src.name}-{archive_name}"
    try:
        write_checkpoint_archive(src, archive)
        files[archive_name] = {"sha256": store.put_file(f"{prefix}/{archive_name}", archive),
                               "bytes": archive.stat().st_size}
    finally:
        archive.unlink(missing_ok=True)
    body = (src / MANIFEST).read_bytes()
    files[f"{sub}{MANIFEST}"] = {"sha256": store.put_bytes(f"{prefix}/{sub}{MANIFEST}", body), "bytes": len(body)}
    return files


def upload_checkpoint(store: ObjectStore, job_id: str, epoch: int, checkpoint_dir: Path) -> tuple[str, dict]:
    """Store a complete local checkpoint; returns (prefix, {relative path: {sha256, bytes}})."""
    prefix = checkpoint_prefix(job_id, epoch, checkpoint_dir.name)
    return prefix, upload_tree(store, prefix, checkpoint_dir, ARCHIVE)


def download_checkpoint(store: ObjectStore, prefix: str, files: dict, dest: Path) -> Path:
    """Fetch a stored checkpoint into dest (atomically); hashes are checked again when it loads."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    try:
        for rel, meta in files.items():
            # The archive repeats the files; a merged export (worker/model/export.py) is for download, not resuming.
            if rel in (ARCHIVE, MERGED_ARCHIVE) or rel.startswith(f"{MERGED_DIR}/"):
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
    orphans = sorted({"/".join(key.split("/")[:CHECKPOINT_PREFIX_DEPTH]) for key in store.list(within)} - referenced)
    for prefix in orphans:
        store.delete_prefix(prefix)
    return orphans
