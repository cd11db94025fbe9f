"""A job's files as {relative name: bytes}: what travels to the ranks (and checkpoints back) through Ray.

No shared filesystem is assumed between the driver and the Ray nodes, nor
between the nodes. Names are relative and may not climb out of the root.
Checkpoints keep their manifest of sha256 hashes, checked when they load.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath


def pack(sources: dict[str, Path]) -> dict[str, bytes]:
    """Every file of each source (a file, or a directory walked whole) under its name."""
    files: dict[str, bytes] = {}
    for name, source in sources.items():
        source = Path(source)
        if source.is_file():
            files[name] = source.read_bytes()
            continue
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            files[f"{name}/{path.relative_to(source).as_posix()}"] = path.read_bytes()
    return files


def _safe(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"refused file name {name!r}: not relative to the job's root")
    return path


def unpack(files: dict[str, bytes], root: Path) -> None:
    for name, data in files.items():
        target = Path(root, *_safe(name).parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def unpack_dir(files: dict[str, bytes], target: Path) -> Path:
    """Write a directory whole, then move it into place: a reader never sees half of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    unpack(files, staging)
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    return target
